"""How a hand-written kernel meets tinygrad's graph (`models.kernels.cuda.run`), shown with a C kernel on the CPU:
it reads each input's values in their logical order, and an input that is another kernel's output reshaped (or with
only axes of one moved) is read where it lies, without a copy first."""

import numpy as np
from tinygrad import Tensor, dtypes

from models.kernels import cuda

TIMES_TEN = "void times_ten(float* restrict out, const float* restrict x) { for (int i = 0; i < 6; i++) out[i] = 10.0f * x[i]; }"


def times_ten(x: Tensor) -> Tensor:
    prog = cuda.program("CPU", "times_ten", TIMES_TEN, grid=(1, 1, 1), threads=1, buffers=2, ops=6, traffic=48)
    return cuda.run(Tensor.empty(6, dtype=dtypes.float32, device="CPU"), (x,), prog)


def twice_times_ten(view=lambda t: t.reshape(3, 1, 2)) -> Tensor:
    first = times_ten(Tensor.arange(6, dtype=dtypes.float32, device="CPU").realize())
    return times_ten(view(first))


def test_a_reshaped_kernel_output_is_read_where_it_lies():
    assert len(twice_times_ten().schedule_linear().src) == 2  # the two kernels, no copy between them
    assert np.array_equal(twice_times_ten().numpy(), 100 * np.arange(6))


def test_a_kernel_output_with_only_axes_of_one_moved_is_read_where_it_lies():
    def moved(t: Tensor) -> Tensor:
        return t.reshape(3, 1, 2).permute(1, 0, 2)

    assert len(twice_times_ten(moved).schedule_linear().src) == 2
    assert np.array_equal(twice_times_ten(moved).numpy(), 100 * np.arange(6))


def test_a_transposed_input_is_read_in_its_logical_order():
    x = Tensor.arange(6, dtype=dtypes.float32, device="CPU").reshape(2, 3).realize()
    assert np.array_equal(times_ten(x.T.reshape(6)).numpy(), 10 * np.arange(6).reshape(2, 3).T.reshape(6))
