"""Small layouts and nodes for planner tests: hand-made for golden cases, generated for properties."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from planner import BlockLayout, ModelLayout, MoESpec, NodeDescriptor

GiB = 1024**3


def toy_layout(
    n_blocks: int,
    *,
    block_bytes: int = GiB,
    block_flops: int = 10**9,
    kv_bytes: int = 0,
    moe: MoESpec | None = None,
    moe_from: int = 0,
    ends_bytes: int = 0,
    name: str = "toy",
) -> ModelLayout:
    blocks = tuple(
        BlockLayout(param_bytes=block_bytes, flops_per_token=block_flops, kv_bytes_per_token=kv_bytes,
                    activation_bytes=1024, moe=moe if (moe and i >= moe_from) else None)
        for i in range(n_blocks)
    )
    return ModelLayout(name=name, dtype="bf16", blocks=blocks, embedding_bytes=ends_bytes, head_bytes=ends_bytes,
                       head_flops_per_token=0, hidden_size=512, vocab_size=1000)


def node(peer: str, mem_gib: float, *, flops: float = 1e12, bw: float = 1e15, rtt: dict[str, float] | None = None,
         uplink: float = 1e12) -> NodeDescriptor:
    return NodeDescriptor(peer_id=peer, memory_total=int(mem_gib * GiB), memory_free=int(mem_gib * GiB), flops=flops,
                          mem_bandwidth=bw, uplink_bps=uplink, rtt_ms=rtt or {})


@st.composite
def layouts(draw: st.DrawFn, moe: bool | None = None) -> ModelLayout:
    n_blocks = draw(st.integers(1, 12))
    is_moe = draw(st.booleans()) if moe is None else moe
    spec = None
    if is_moe:
        n_exp = draw(st.integers(2, 12))
        spec = MoESpec(n_experts=n_exp, top_k=draw(st.integers(1, min(4, n_exp))),
                       bytes_per_expert=draw(st.integers(1, 64)) * 2**20, flops_per_expert_token=10**8)
    return toy_layout(
        n_blocks,
        block_bytes=draw(st.integers(1, 512)) * 2**20,
        block_flops=draw(st.integers(1, 100)) * 10**8,
        kv_bytes=draw(st.integers(0, 4096)),
        moe=spec,
        moe_from=draw(st.integers(0, n_blocks - 1)),
        ends_bytes=draw(st.integers(0, 256)) * 2**20,
    )


@st.composite
def fleets(draw: st.DrawFn, min_nodes: int = 1, max_nodes: int = 6,
           rtts: Sequence[float] = (0.2, 1.0, 5.0, 30.0, 80.0)) -> list[NodeDescriptor]:
    """Nodes with distinct ids, memory from 0.5 to 16 GiB, speeds within 10x, RTTs from `rtts`."""
    count = draw(st.integers(min_nodes, max_nodes))
    ids = draw(st.lists(st.text("abcdefgh", min_size=1, max_size=4), min_size=count, max_size=count, unique=True))
    ids = [f"peer-{i}" for i in ids]
    nodes = []
    for i, peer in enumerate(ids):
        rtt = {other: draw(st.sampled_from(list(rtts))) for other in ids[:i]}
        nodes.append(NodeDescriptor(
            peer_id=peer,
            memory_total=draw(st.integers(1, 32)) * GiB // 2,
            memory_free=0,
            flops=draw(st.sampled_from([1e11, 2e11, 5e11, 1e12])),
            mem_bandwidth=draw(st.sampled_from([1e10, 5e10, 1e11])),
            uplink_bps=draw(st.sampled_from([1e8, 1e9])),
            rtt_ms=rtt,
        ))
    return [NodeDescriptor(**{**n.__dict__, "memory_free": n.memory_total}) for n in nodes]
