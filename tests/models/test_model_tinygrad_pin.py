"""tinygrad.llm is what the models build on; its 0.14.0 wheel ships a model.py that fails to import."""

from importlib.metadata import version


def test_tinygrad_llm_model_imports_with_the_pinned_version():
    from tinygrad.llm.model import Transformer, TransformerBlock, TransformerConfig  # noqa: F401

    assert version("tinygrad") == "0.13.0"
