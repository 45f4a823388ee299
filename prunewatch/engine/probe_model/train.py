"""Build the bundled probe model: a byte-level BPE tokenizer and a small Llama trained offline.

The probe model exists so that prunewatch runs end to end on a machine with no weights and no
network. It proves the plumbing (bypass, counting, stats, storage), not pruning quality on large
models, and every number measured on it is labelled as a probe-model number.

Reproducibility: a fixed seed, a corpus read in sorted order, a fixed number of steps and thread
count; the manifest records the corpus digest, config, steps, validation perplexity, the sha256
of the weights and the exact command, so a rebuild can be compared file for file.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from prunewatch.engine.probe_model.corpus import CorpusReport, default_sources, iter_documents


@dataclass(frozen=True)
class ProbeModelConfig:
    """Shape and training schedule of the probe model; sized for two CPU cores in ~12 minutes."""

    vocab_size: int = 4096  # byte-level BPE; small so the output layer is not most of the compute
    hidden_size: int = 192  # wide enough to learn English structure, narrow enough for CPU training
    intermediate_size: int = 512  # ~8/3 x hidden, the SwiGLU ratio Llama uses
    num_hidden_layers: int = 12  # depth matters more than width here: layer bypass needs layers to skip
    num_attention_heads: int = 6  # head_dim 32
    num_key_value_heads: int = 2  # grouped-query attention, as in Llama 3 / Mistral, to exercise GQA paths
    max_position_embeddings: int = 512  # probes are short; RoPE extrapolates a little beyond
    seq_len: int = 128  # training context; probes plus 64 new tokens fit
    batch_size: int = 16  # sequences per step
    steps: int = 600  # fixed so the build is reproducible; ~1.2 M tokens seen
    warmup_steps: int = 40
    learning_rate: float = 2e-3  # high for a small model trained briefly, decayed by cosine
    weight_decay: float = 0.05
    embedding_init_std: float = 1.0  # unit-scale embeddings: see _init_weights (layer-0 artefact)
    val_fraction: float = 0.02  # held-out share of the corpus for validation perplexity
    val_batches: int = 20
    seed: int = 1234
    threads: int = 2


SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}### System:\n{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}### Question:\n{{ message['content'] }}\n\n"
    "{% else %}### Answer:\n{{ message['content'] }}\n\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}### Answer:\n{% endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int):  # -> tokenizers.Tokenizer
    """Byte-level BPE (GPT-2 style): any byte sequence is representable, so no unknown token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _init_weights(model: torch.nn.Module, config: ProbeModelConfig) -> None:
    """Fix the layer-0 artefact of the default init.

    With embeddings drawn at std 0.02 the first block's output is many times the token
    embedding, so layer 0 rewrites the residual stream almost entirely and its calibrated
    influence (1 - cos(in, out)) saturates near 1 while later layers look negligible. Unit-scale
    embeddings and residual projections scaled by 1/sqrt(2 * layers) (GPT-2's rule) keep every
    block's update commensurate with the stream it adds to.
    """
    residual_std = 0.02 / math.sqrt(2 * config.num_hidden_layers)
    for name, param in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            torch.nn.init.normal_(param, std=config.embedding_init_std)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.nn.init.normal_(param, std=residual_std)


def _encode_stream(tokenizer, texts: list[str], eos_id: int) -> torch.Tensor:
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def _batches(stream: torch.Tensor, seq_len: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])  # (B, T)


@torch.no_grad()
def validation_perplexity(model, stream: torch.Tensor, config: ProbeModelConfig) -> float:
    """Mean token cross-entropy over fixed held-out windows, exponentiated."""
    model.eval()
    generator = torch.Generator().manual_seed(config.seed + 1)
    losses = []
    for _ in range(config.val_batches):
        batch = _batches(stream, config.seq_len, config.batch_size, generator)
        losses.append(model(input_ids=batch, labels=batch).loss.item())
    model.train()
    return math.exp(sum(losses) / len(losses))


def residual_growth_after_layer0(model, stream: torch.Tensor) -> float:
    """||h after block 0|| / ||embedding||: the artefact this build fixes shows as a ratio in the hundreds."""
    ids = stream[:128].unsqueeze(0)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    h0, h1 = out.hidden_states[0], out.hidden_states[1]
    return float(h1.norm(dim=-1).mean() / h0.norm(dim=-1).mean())


def build_probe_model(
    out_dir: Path,
    config: ProbeModelConfig = ProbeModelConfig(),
    progress: Callable[[int, int, float], None] | None = None,
    command: str = "",
) -> dict:
    """Train tokenizer and model, save them as a Hugging Face folder with a manifest; return it."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    started = time.time()
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    torch.set_num_threads(config.threads)

    report = CorpusReport()
    texts = list(iter_documents(default_sources(), report))
    if report.total_bytes < 1_000_000:
        raise RuntimeError(
            f"only {report.total_bytes} bytes of corpus found; install python3.11-doc and man pages "
            "(apt-get install python3.11-doc man-db) and retry"
        )
    rng = random.Random(config.seed)
    order = list(range(len(texts)))
    rng.shuffle(order)
    n_val = max(1, int(len(order) * config.val_fraction))
    val_texts = [texts[i] for i in order[:n_val]]
    train_texts = [texts[i] for i in order[n_val:]]

    tokenizer = train_tokenizer(train_texts, config.vocab_size)
    eos_id = tokenizer.token_to_id("</s>")
    train_stream = _encode_stream(tokenizer, train_texts, eos_id)
    val_stream = _encode_stream(tokenizer, val_texts, eos_id)

    llama_config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.token_to_id("<s>"),
        eos_token_id=eos_id,
        pad_token_id=tokenizer.token_to_id("<pad>"),
    )
    model = LlamaForCausalLM(llama_config)
    _init_weights(model, config)
    growth_at_init = residual_growth_after_layer0(model, val_stream)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.learning_rate,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(config.seed)
    model.train()
    for step in range(config.steps):
        if step < config.warmup_steps:
            lr = config.learning_rate * (step + 1) / config.warmup_steps
        else:
            progress_frac = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
            lr = config.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress_frac)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = _batches(train_stream, config.seq_len, config.batch_size, generator)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if progress is not None:
            progress(step + 1, config.steps, loss.item())

    val_ppl = validation_perplexity(model, val_stream, config)
    growth_trained = residual_growth_after_layer0(model, val_stream)

    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.float16)
    llama_config.dtype = "float16"
    llama_config.save_pretrained(out_dir)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    weights_path = out_dir / "model.safetensors"
    save_file(state, str(weights_path), metadata={"format": "pt"})
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)

    manifest = {
        "name": "prunewatch-probe-llama",
        "purpose": "plumbing and tests; numbers measured on it are probe-model numbers",
        "command": command,
        "corpus": {"sources": report.sources, "total_bytes": report.total_bytes, "sha256": report.sha256,
                   "documents": len(texts), "train_tokens": int(train_stream.numel()),
                   "val_tokens": int(val_stream.numel())},
        "config": asdict(config),
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "steps": config.steps,
        "tokens_seen": config.steps * config.batch_size * config.seq_len,
        "validation_perplexity": round(val_ppl, 2),
        "residual_growth_after_layer0": {"at_init": round(growth_at_init, 3), "trained": round(growth_trained, 3)},
        "weights_sha256": hashlib.sha256(weights_path.read_bytes()).hexdigest(),
        "train_seconds": round(time.time() - started, 1),
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "machine": platform.machine(), "argv": sys.argv},
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
