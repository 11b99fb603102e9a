"""Train the default model: a small Qwen3.6 of the real architecture on the Python docs.

The architecture is MODEL.md's at small sizes, built with transformers' `Qwen3_5MoeForCausalLM`
(the oracle; eager attention): Gated DeltaNet layers with full (gated) attention at i%4==3, every
layer MoE with a sigmoid-gated shared expert, rope_parameters explicit (theta 1e7, rotary 1/4 of
the head; MODEL.md §8). Data: `train.txt` / `heldout.txt` and the tokenizer from
training/corpus.py (`--data`); documents are joined with `<|endoftext|>` and the model sees
random windows of `context + 1` tokens (seeded). Training: AdamW, linear warm-up then cosine decay
to 10%, gradient clipping, bf16 autocast on CUDA (fp32 master weights), fp32 on CPU.

Routing (`--routing`, ROUTINGS): `default`, the embedded model's: the preset's experts and top-k,
a per-layer load-balancing loss at coefficient 0.01 that keeps every expert in use (its routing is
nearly flat). `real` (REAP's evaluation model), fixed before its first run and not tuned
to the result: the real checkpoint's routing recipe (model/synth.py REAL_TEXT_CONFIG): 256 experts,
top-8, router_aux_loss_coef 0.001 on transformers' own `load_balancing_loss_func` (the form the
config's coefficient belongs to: Switch's E·Σ_e f_e·P_e with f and P pooled over all layers, k
when balanced); every other size, the data, optimiser and schedule the preset's. Its pull on one
router probability, relative to the LM loss, is coef·k/L when balanced: 1e-3 with 8 layers (the
real model's 40: 2e-4; the default recipe's coef/L: 1.25e-3), but only the sum over layers of
expert e's load is balanced, so one layer may concentrate. The evaluation model on one
CPU core (the `default` preset there took 24-80 s a step and 13.5 GB; `small`, 1.4 s, 1.6 GB), 2400
steps (2.1 epochs of the preset's 3.5):

    python -m training.train --data CORPUS --out /tmp/reapeval/hf --routing real \
        --preset small --steps 2400 --evals 4 --eval-tokens 65536 --device cpu --threads 1
    python -m fermijit convert /tmp/reapeval/hf /tmp/reapeval/fj

On the GPU machine tests/reap_eval_pass.sh trains the `default` preset this way (`--minutes 7`:
up to its 3.5 epochs) and benches it.

Budget: `--steps N` trains N steps (`--minutes` then only stops it early); `--minutes M` alone
times the first steps and fixes N so that the run ends in about M minutes, but at most the
preset's `max_epochs` passes over the data (the default model reaches that first: 1017 steps,
about 4 minutes of an H200). N is printed; `--steps N` reproduces the schedule (CUDA kernels are
not bitwise deterministic). Held-out loss and perplexity are logged `--evals` times.

`--mtp-for MODEL` trains an MTP head for a converted model instead (`train_mtp` below).

Output (`--out`): a text-only HF checkpoint that transformers and fermijit's converter read:
config.json (`qwen3_5_moe_text`, fields that model/config.py knows), safetensors under the
in-memory names (`model.layers.{i}...`, fused experts `mlp.experts.gate_up_proj` [E, 2I, H]),
bf16 except A_log (F32, as published), in shards under 15 MiB; the tokenizer and generation files
and NOTICE.txt from `--data`; `train_log.json` (arguments, config, parameter counts, loss curve).

    python -m training.train --data build/default_corpus --out OUT --minutes 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch

from training.corpus import EOT, read_documents

COPIED_FROM_DATA = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                    "NOTICE.txt", "copyright")
SHARD_BYTES = 15 << 20  # each file < 16 MiB: what one file from the GPU machine may be
ROPE_THETA = 1e7        # the real model's (MODEL.md §2); transformers' fallback is 1e4
PROGRESS_S = 30         # a progress line at least this often (the curve keeps every 10th step)


@dataclasses.dataclass(frozen=True)
class Shape:
    """Model sizes (HF names, MODEL.md §2) and the batch it trains with."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    context: int     # tokens per training window
    batch: int       # windows per step
    lr: float        # peak learning rate
    max_epochs: float  # with --minutes alone: at most this many passes over train.txt


@dataclasses.dataclass(frozen=True)
class Routing:
    """The routed experts' shape and load-balancing recipe laid over a preset."""

    num_experts: int | None           # None: the preset's
    num_experts_per_tok: int | None   # None: the preset's
    aux_coef: float                   # config.json's router_aux_loss_coef
    aux_form: str                     # "per-layer" (load_balancing_loss) | "pooled" (transformers')


def _real_routing() -> Routing:
    from fermijit.model.synth import REAL_TEXT_CONFIG as real

    return Routing(real["num_experts"], real["num_experts_per_tok"],
                   real["router_aux_loss_coef"], "pooled")


ROUTINGS = {"default": lambda: Routing(None, None, 0.01, "per-layer"), "real": _real_routing}


def routed(shape: "Shape", routing: Routing) -> "Shape":
    """`shape` with `routing`'s expert count and top-k."""
    return dataclasses.replace(
        shape, num_experts=routing.num_experts or shape.num_experts,
        num_experts_per_tok=routing.num_experts_per_tok or shape.num_experts_per_tok)


PRESETS = {
    # The committed model. Data-limited (2.38 M training tokens), measured on one H200 with
    # bf16 autocast (held-out loss, 131k tokens): 28.7 M parameters beat 17.4 M (3.60 vs 3.68 after
    # 4 epochs at batch 64); batch 16 beats 64 at equal epochs (3.39 vs 3.60: 4x the updates);
    # held-out loss is lowest near 3.5 epochs and rises after (3.39 at 3.5, 3.41 at 4; at batch
    # 64, 3.50 at 4.8 epochs, 3.57 at 6.6). Its bf16 checkpoint (57 MB) is near the 64 MiB that
    # comes back from the GPU machine; Q4_0-converted it is 23 MB. ~0.2 s per step on the H200.
    "default": Shape(hidden_size=384, num_hidden_layers=8, num_attention_heads=6,
                     num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
                     linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                     num_experts=16, num_experts_per_tok=2, moe_intermediate_size=96,
                     shared_expert_intermediate_size=256, context=512, batch=16, lr=1.5e-3,
                     max_epochs=3.5),
    # The same layer pattern at a size a CPU trains in minutes (end-to-end checks).
    "small": Shape(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                   num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                   shared_expert_intermediate_size=64, context=128, batch=16, lr=3e-3,
                   max_epochs=3.5),
    # The smoke test's: seconds on a CPU.
    "tiny": Shape(hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, linear_num_key_heads=1,
                  linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, context=64, batch=8, lr=3e-3,
                  max_epochs=3.5),
}


def text_config(shape: Shape, vocab_size: int, eot_id: int, pad_id: int,
                aux_coef: float = 0.01) -> dict:
    """config.json: only fields model/config.py's TextConfig knows (it rejects the rest)."""
    n = shape.num_hidden_layers
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": n,
        "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)],
        "full_attention_interval": 4,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "attn_output_gate": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "linear_num_key_heads": shape.linear_num_key_heads,
        "linear_num_value_heads": shape.linear_num_value_heads,
        "linear_key_head_dim": shape.linear_key_head_dim,
        "linear_value_head_dim": shape.linear_value_head_dim,
        "linear_conv_kernel_dim": 4,
        "num_experts": shape.num_experts,
        "num_experts_per_tok": shape.num_experts_per_tok,
        "moe_intermediate_size": shape.moe_intermediate_size,
        "shared_expert_intermediate_size": shape.shared_expert_intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        # Trained on `context`-token windows; longer prompts run but were never seen in training.
        "max_position_embeddings": 4 * shape.context,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA,
                            "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                            "mrope_interleaved": True},
        "tie_word_embeddings": False,
        "mamba_ssm_dtype": "float32",
        "mtp_num_hidden_layers": 0,
        "output_router_logits": False,
        "router_aux_loss_coef": aux_coef,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "pad_token_id": pad_id,
        "dtype": "bfloat16",
    }


EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")  # transformers' MoE kernels


def build_model(config: dict, seed: int, experts: str = "grouped_mm"):
    """The transformers model, initialised on the CPU from `seed` (same weights on any device).
    `experts` picks transformers' routed-expert kernel; all compute the same function."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    hf_config = Qwen3_5MoeTextConfig(**{k: v for k, v in config.items() if k != "architectures"})
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(hf_config).float()
    model.set_experts_implementation(experts)
    return model


def parameter_counts(model, config: dict) -> dict:
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    share = config["num_experts_per_tok"] / config["num_experts"]
    return {"total": total, "routed_experts": experts,
            "active_per_token": int(total - experts + experts * share),
            "embedding": model.model.embed_tokens.weight.numel(),
            "lm_head": model.lm_head.weight.numel()}


def converted_nbytes(model) -> int:
    """fermijit's model.safetensors size for these weights (model/convert.py quantisation():
    Q4_0 18 B / 32, Q8_0 lm_head 34 B / 32, fp16 embedding, fp32 the rest), headers aside."""
    from fermijit.model.convert import Q4_0_FIELDS

    nbytes = 0
    for name, p in model.named_parameters():
        n = p.numel()
        leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
        if name == "lm_head.weight":
            nbytes += n // 32 * 34
        elif name == "model.embed_tokens.weight":
            nbytes += 2 * n
        elif leaf in Q4_0_FIELDS or leaf in ("gate_up_proj", "down_proj", "gate_proj", "up_proj"):
            nbytes += n // 32 * 18  # (shared_expert.* map to shared_gate_up / shared_down)
        else:
            nbytes += 4 * n
    return nbytes


def load_tokens(data: Path, split: str) -> torch.Tensor:
    """int64 ids of a split: <|endoftext|> before every document, and one at the end."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(data / "tokenizer.json"))
    eot = tokenizer.token_to_id(EOT)
    ids = [eot]
    for encoding in tokenizer.encode_batch(read_documents(data / f"{split}.txt"),
                                           add_special_tokens=False):
        ids += encoding.ids + [eot]
    return torch.tensor(ids, dtype=torch.int64)


def load_balancing_loss(router_logits: tuple, k: int) -> torch.Tensor:
    """Switch Transformer's balance loss E·Σ_e f_e·P_e per layer (f_e: share of the top-k picks,
    P_e: mean router probability; 1.0 when balanced), averaged over layers. transformers' own
    pools all layers into one count, which let single experts of a layer die (measured on the
    H200: min per-layer share 0.0004 of a balanced one after 480 steps)."""
    losses = []
    for logits in router_logits:                                     # [N, E]
        probs = logits.float().softmax(dim=-1)
        top = probs.topk(k, dim=-1).indices.reshape(-1)              # [N·k]
        picks = torch.ones_like(top, dtype=probs.dtype)
        share = torch.zeros_like(probs[0]).index_add_(0, top, picks)
        losses.append(probs.shape[-1] * (share / top.numel() * probs.mean(dim=0)).sum())
    return torch.stack(losses).mean()


def aux_loss_of(routing: Routing, router_logits: tuple, n_experts: int, k: int) -> torch.Tensor:
    if routing.aux_form == "pooled":
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

        return load_balancing_loss_func(router_logits, n_experts, k)
    return load_balancing_loss(router_logits, k)


def lr_at(step: int, n_steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, n_steps - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model, tokens: torch.Tensor, context: int, batch: int, device,
             max_tokens: int) -> dict:
    """Mean NLL over non-overlapping `context`-token windows of `tokens` (each window predicts
    its tokens 1..context from the ones before, within the window), and the experts' load."""
    model.eval()
    n_windows = max(1, min((len(tokens) - 1) // context, max_tokens // context))
    windows = tokens[:n_windows * context + 1]
    nll_sum, n_tokens, load = 0.0, 0, None
    for w0 in range(0, n_windows, batch):
        idx = torch.arange(w0, min(n_windows, w0 + batch))
        x = torch.stack([windows[i * context:(i + 1) * context + 1]
                         for i in idx.tolist()]).to(device)
        with _autocast(device):
            out = model(input_ids=x[:, :-1], output_router_logits=True)
        logits = out.logits.float()
        nll_sum += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        n_tokens += x[:, 1:].numel()
        top = torch.stack([r.topk(model.config.num_experts_per_tok, dim=-1).indices
                           for r in out.router_logits])              # [L, tokens, k]
        counts = torch.stack([torch.bincount(t.reshape(-1), minlength=model.config.num_experts)
                              for t in top]).float()                  # [L, E]
        load = counts if load is None else load + counts
    model.train()
    share = load / load.sum(dim=1, keepdim=True) * model.config.num_experts  # 1.0 = balanced
    nll = nll_sum / n_tokens
    return {"tokens": n_tokens, "loss": nll, "ppl": math.exp(nll),
            "expert_load_min": share.min().item(), "expert_load_max": share.max().item()}


def _autocast(device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def save_checkpoint(model, config: dict, data: Path, out: Path, log: dict) -> list[str]:
    """config.json, bf16 safetensors shards (+ index), tokenizer files, NOTICE, train_log.json."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, p in model.state_dict().items():
        dtype = torch.float32 if name.endswith("A_log") else torch.bfloat16
        tensors[name] = p.detach().to("cpu", dtype).contiguous()
    shards, size = [[]], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    for names, file in zip(shards, files):
        save_file({n: tensors[n] for n in names}, str(out / file), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                                for t in tensors.values())},
                 "weight_map": {n: f for names, f in zip(shards, files) for n in names}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in COPIED_FROM_DATA:
        if (data / file).is_file():
            shutil.copyfile(data / file, out / file)
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    return files


def train(data: Path, out: Path, shape: Shape, steps: int | None, minutes: float | None,
          seed: int = 0, evals: int = 10, eval_tokens: int = 1 << 17, device: str | None = None,
          warmup: int | None = None, weight_decay: float = 0.1, max_epochs: float | None = None,
          experts: str = "grouped_mm", routing: Routing | None = None,
          quiet: bool = False) -> dict:
    """Train, evaluate, save; returns the log (also written to out/train_log.json). `routing`
    (default ROUTINGS["default"]) sets the experts, top-k and balancing loss over `shape`."""
    if steps is None and minutes is None:
        raise ValueError("give steps, minutes or both")
    routing = routing or ROUTINGS["default"]()
    shape = routed(shape, routing)
    t_start = time.monotonic()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def say(record: dict) -> None:
        if not quiet:
            print(json.dumps(record), flush=True)

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(data / "tokenizer.json"))
    config = text_config(shape, tokenizer.get_vocab_size(), tokenizer.token_to_id(EOT),
                         tokenizer.token_to_id("<|pad|>"), routing.aux_coef)
    train_tokens, heldout_tokens = load_tokens(data, "train"), load_tokens(data, "heldout")
    model = build_model(config, seed, experts).to(dev)
    counts = parameter_counts(model, config)
    log = {"args": {"data": str(data), "steps": steps, "minutes": minutes, "seed": seed,
                    "device": str(dev), "shape": dataclasses.asdict(shape),
                    "weight_decay": weight_decay, "max_epochs": max_epochs, "experts": experts,
                    "routing": dataclasses.asdict(routing)},
           "torch": torch.__version__, "transformers": _transformers_version(),
           "train_tokens": len(train_tokens), "heldout_tokens": len(heldout_tokens),
           "parameters": counts, "converted_nbytes_estimate": converted_nbytes(model),
           "curve": [], "evals": []}
    say({k: log[k] for k in ("args", "train_tokens", "heldout_tokens", "parameters",
                             "converted_nbytes_estimate")})

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=shape.lr, betas=(0.9, 0.95), eps=1e-8,
                                  fused=dev.type == "cuda")
    generator = torch.Generator().manual_seed(seed)
    n_windows = len(train_tokens) - shape.context - 1
    budget_s = None if minutes is None else 60 * minutes
    epochs = shape.max_epochs if max_epochs is None else max_epochs
    # --minutes alone: the epoch cap, lowered below if the first steps show it will not fit.
    n_steps = steps if steps is not None else math.ceil(epochs * len(train_tokens)
                                                        / (shape.batch * shape.context))

    def warmup_for(n: int) -> int:
        return warmup if warmup is not None else min(100, max(1, n // 20))

    warmup_steps = warmup_for(n_steps)
    eval_every = max(1, n_steps // evals) if steps is not None else None
    timing_steps, t_train, last_said = 10, None, 0.0
    model.train()
    step = 0
    while step < n_steps:
        if step == 2:  # after the first steps' one-off costs (allocator, kernel selection)
            _sync(dev)
            t_train = time.monotonic()
        if steps is None and step == 2 + timing_steps:
            _sync(dev)
            per_step = (time.monotonic() - t_train) / timing_steps
            eval_s = _time_eval(model, heldout_tokens, shape, dev, eval_tokens)
            left = budget_s - (time.monotonic() - t_start) - 30  # saving, final eval
            fits = max(step + 1, step + int((left - evals * eval_s) / per_step))
            n_steps = min(n_steps, fits)
            eval_every = max(1, n_steps // evals)
            warmup_steps = warmup_for(n_steps)
            log["schedule"] = {"step_s": per_step, "eval_s": eval_s, "steps": n_steps,
                               "limited_by": "epochs" if n_steps < fits else "minutes"}
            say({"schedule": log["schedule"], "note": f"reproduce with --steps {n_steps}"})
        starts = torch.randint(0, n_windows, (shape.batch,), generator=generator)
        x = torch.stack([train_tokens[s:s + shape.context + 1] for s in starts.tolist()]).to(dev)
        lr = lr_at(step, n_steps, shape.lr, warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with _autocast(dev):
            result = model(input_ids=x[:, :-1], output_router_logits=True)
        logits = result.logits.float()
        lm_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                    x[:, 1:].reshape(-1))
        aux_loss = aux_loss_of(routing, result.router_logits, shape.num_experts,
                               shape.num_experts_per_tok)
        loss = lm_loss + config["router_aux_loss_coef"] * aux_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        elapsed = time.monotonic() - t_start
        logged = step % 10 == 0 or step == 1 or step == n_steps
        if logged or elapsed - last_said > PROGRESS_S:  # a CPU step can take many seconds
            record = {"step": step, "of": n_steps, "loss": round(lm_loss.item(), 4),
                      "aux": round(aux_loss.item(), 4),
                      "grad_norm": round(grad_norm.item(), 3), "lr": round(lr, 6),
                      "elapsed_s": round(elapsed, 1)}
            if logged:
                log["curve"].append(record)
            say(record)
            last_said = elapsed
        if eval_every and (step % eval_every == 0 or step == n_steps):
            heldout = {"step": step, **evaluate(model, heldout_tokens, shape.context, shape.batch,
                                                dev, eval_tokens)}
            if not log["evals"] or log["evals"][-1]["step"] != step:
                log["evals"].append(heldout)
                say({"heldout": heldout})
        if budget_s is not None and time.monotonic() - t_start > budget_s - 20:
            say({"stopped": "wall-clock budget", "step": step})
            break
    log["steps_done"] = step
    log["train_s"] = round(time.monotonic() - t_start, 1)
    if not log["evals"] or log["evals"][-1]["step"] != step:
        log["evals"].append({"step": step, **evaluate(model, heldout_tokens, shape.context,
                                                      shape.batch, dev, eval_tokens)})
        say({"heldout": log["evals"][-1]})
    log["files"] = save_checkpoint(model, config, data, out, log)
    say({"saved": str(out), "files": log["files"], "total_s": round(time.monotonic() - t_start, 1)})
    return log


def _time_eval(model, tokens, shape: Shape, dev, eval_tokens: int) -> float:
    _sync(dev)
    t0 = time.monotonic()
    evaluate(model, tokens, shape.context, shape.batch, dev, eval_tokens)
    _sync(dev)
    return time.monotonic() - t0


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


# --- the MTP head (issue 32 item 3) ---------------------------------------------------------------
# A multi-token-prediction head (MODEL.md §10) for a converted model, trained with the model frozen:
# row q reads the model's final normed hidden state q (as fermijit's 4-bit forward computes it:
# the states the head meets when drafting) and token q+1, and learns the model's own distribution
# of token q+2 (its logits at position q+1, top MTP_TEACHER_TOP of them): a draft is accepted when
# it is what the model would say, so the model, not the text, is the teacher. The head's layer is
# transformers' Qwen3.5-MoE full-attention decoder layer; the embedding and LM head are the model's
# (fp16 and Q8_0 as stored, dequantised), frozen.

MTP_TEACHER_TOP = 32    # teacher probabilities kept per position (the rest of the mass dropped)
MTP_LAYER_INDEX = 3     # a full-attention index of the presets' layer_types, for the HF layer
MTP_WINDOWS = 1200      # training windows of the model's context (1200 x 512 = 614k tokens)


def model_states(model, tokens, context: int, n_windows: int, on_window=lambda: None):
    """The model's final normed hidden states and its top teacher probabilities over windows of
    `context` tokens spread over `tokens`, each from a fresh state: (ids [W, T] int64, hidden
    [W, T, H] fp16, teacher ids [W, T, K] int64, teacher p [W, T, K] fp16); position t's teacher
    is the model's distribution of token t+1."""
    import numpy as np

    from fermijit.model.forward import Workspace, linear
    from fermijit.ops import rmsnorm

    tokens = np.asarray(tokens, np.int32)
    n_whole = (len(tokens) - 1) // context
    starts = np.round(np.linspace(0, n_whole - 1, min(n_windows, n_whole))).astype(int) * context
    W, T, H, K = len(starts), context, model.hidden, MTP_TEACHER_TOP
    ids = np.empty((W, T), np.int64)
    hidden = np.empty((W, T, H), np.float16)
    top_ids = np.empty((W, T, K), np.int64)
    top_p = np.empty((W, T, K), np.float16)
    ws = Workspace(model, T)
    logits = np.empty((T, model.vocab_size), np.float32)
    for w, s in enumerate(starts):
        ws.tokens[:] = tokens[s:s + T]
        model.forward(ws.tokens, model.new_state(T), ws)
        h = rmsnorm.cpu(ws.x, model.norm, model.eps)
        linear(h, model.lm_head, logits)
        top = np.argpartition(-logits, K - 1, axis=1)[:, :K]
        m = logits.max(axis=1, keepdims=True)
        total = np.exp(logits - m).sum(axis=1, keepdims=True)
        ids[w], hidden[w], top_ids[w] = ws.tokens, h, top
        top_p[w] = np.exp(np.take_along_axis(logits, top, axis=1) - m) / total
        on_window()
    return ids, hidden, top_ids, top_p


class MtpHead(torch.nn.Module):
    """The head in torch (MODEL.md §10), its layer transformers' own; embedding and LM head
    frozen buffers."""

    def __init__(self, config: dict, embed: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        from transformers import Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

        cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in config.items() if k != "architectures"})
        cfg._attn_implementation = "sdpa"  # causal without a mask (training windows)
        assert cfg.layer_types[MTP_LAYER_INDEX] == "full_attention"
        H = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.pre_fc_norm_embedding = torch.nn.Parameter(torch.zeros(H))
        self.pre_fc_norm_hidden = torch.nn.Parameter(torch.zeros(H))
        self.fc = torch.nn.Linear(2 * H, H, bias=False)
        torch.nn.init.normal_(self.fc.weight, std=cfg.initializer_range)
        self.layer = hf.Qwen3_5MoeDecoderLayer(cfg, MTP_LAYER_INDEX)
        for name, p in self.layer.named_parameters():  # as transformers' _init_weights
            if name.endswith("norm.weight"):
                torch.nn.init.zeros_(p)
            elif p.dim() >= 2:
                torch.nn.init.normal_(p, std=cfg.initializer_range)
        self.norm = torch.nn.Parameter(torch.zeros(H))
        self.rotary = hf.Qwen3_5MoeTextRotaryEmbedding(cfg)
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("lm_head", lm_head, persistent=False)
        self.router_logits = None
        self.layer.mlp.gate.register_forward_hook(
            lambda module, args, out: setattr(self, "router_logits", out[0]))

    def rmsnorm(self, x, w):
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + w)

    def forward(self, next_ids, hidden):
        """next_ids [B, T] (token q+1 of row q), hidden [B, T, H] -> logits [B, T, V]."""
        e = self.rmsnorm(self.embed[next_ids], self.pre_fc_norm_embedding)
        h = self.rmsnorm(hidden, self.pre_fc_norm_hidden)
        x = self.fc(torch.cat([e, h], dim=-1))                         # embedding first
        B, T = next_ids.shape
        positions = torch.arange(T).expand(3, B, T)                     # text: T = H = W axes
        x = self.layer(x, position_embeddings=self.rotary(x, positions))
        return self.rmsnorm(x, self.norm) @ self.lm_head.T

    def load_hf_tensors(self, tensors: dict) -> None:
        """`hf_tensors`' inverse: continue from a saved head."""
        own = {n: p for n, p in self.named_parameters()}
        with torch.no_grad():
            for name, p in self._hf_params().items():
                p.copy_(tensors[name])
        assert len(own) == len(tensors)

    def _hf_params(self) -> dict:
        out = {"mtp.pre_fc_norm_embedding.weight": self.pre_fc_norm_embedding,
               "mtp.pre_fc_norm_hidden.weight": self.pre_fc_norm_hidden,
               "mtp.fc.weight": self.fc.weight, "mtp.norm.weight": self.norm}
        for name, p in self.layer.named_parameters():
            out[f"mtp.layers.0.{name}"] = p
        return out

    def hf_tensors(self) -> dict:
        """The head under the published names (`mtp.*`, fused experts), fp32."""
        return {n: p.detach().float().contiguous() for n, p in self._hf_params().items()}


def _frozen(model):
    """The fermijit model's embedding and LM head as fp32 torch tensors (dequantised)."""
    import numpy as np

    from fermijit.model.reference import dense
    from fermijit.model.weights import QuantTensor
    from fermijit.ops import matvec

    head = model.lm_head
    if isinstance(head, matvec.Q4Matrix):
        head = QuantTensor("q4_0", head.qs, head.d_bits.view(np.float16))
    return (torch.from_numpy(np.asarray(model.embed, np.float32)),
            torch.from_numpy(dense(head).astype(np.float32)))


def mtp_loss(head, ids, hidden, top_ids, top_p, k: int, aux_coef: float):
    """(soft cross-entropy against the model's top probabilities of token q+2, the balance
    loss, the share of rows whose argmax is the model's) over rows q = 0 .. T-2 of a batch."""
    logits = head(ids[:, 1:], hidden[:, :-1].float())                  # row q: token q+1, h_q
    log_q = torch.log_softmax(logits.float(), dim=-1)
    p = top_p[:, 1:].float()                                           # the model at q+1
    ce = -(p * torch.gather(log_q, -1, top_ids[:, 1:])).sum(-1).mean()
    aux = load_balancing_loss((head.router_logits,), k)
    agree = (logits.argmax(-1) == top_ids[:, 1:].gather(
        -1, top_p[:, 1:].float().argmax(-1, keepdim=True))[..., 0]).float().mean()
    return ce, aux, agree


def train_mtp(model_dir: Path, data: Path, out: Path, steps: int | None, minutes: float | None,
              seed: int = 0, batch: int = 8, lr: float = 1e-3, n_windows: int = MTP_WINDOWS,
              quiet: bool = False, states: Path | None = None,
              init: Path | None = None) -> dict:
    """Train an MTP head for fermijit model `model_dir` (frozen) on `data`'s train split; write
    `out/head/model.safetensors` (the head under HF names, fp32) and `out/mtp_log.json`; returns
    the log. The budget as `train`'s: --steps, or --minutes to fix them after timing the first.
    `states`: an .npz file of the model's states (`model_states`), made there once and read on
    later runs (on a busy 2-core machine they took longer than the training). `init`: a head
    directory (`out/head` of an earlier run) to continue from."""
    import numpy as np
    from safetensors.torch import load_file, save_file

    from fermijit.model.forward import load_model

    if steps is None and minutes is None:
        raise ValueError("give steps, minutes or both")
    t_start = time.monotonic()

    def say(record: dict) -> None:
        if not quiet:
            print(json.dumps(record), flush=True)

    cfg, model = load_model(model_dir)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    context = min(512, model.max_context)
    torch.manual_seed(seed)
    names = ("ids", "hidden", "top_ids", "top_p")
    saved = dict(np.load(states)) if states is not None and Path(states).is_file() else {}
    splits = {}
    for split, n in (("train", n_windows), ("heldout", max(8, n_windows // 20))):
        t0 = time.monotonic()
        if f"{split}.ids" not in saved:
            done, last = [0], [t0]

            def on_window() -> None:  # 0.5 s a window on one core: minutes for the train split
                done[0] += 1
                if time.monotonic() - last[0] > PROGRESS_S:
                    last[0] = time.monotonic()
                    say({"states": split, "windows_done": done[0],
                         "s": round(last[0] - t0, 1)})

            arrays = model_states(model, load_tokens(data, split).numpy(), context, n, on_window)
            saved.update({f"{split}.{k}": a for k, a in zip(names, arrays)})
        splits[split] = [torch.from_numpy(saved[f"{split}.{k}"]) for k in names]
        say({"states": split, "windows": int(splits[split][0].shape[0]),
             "s": round(time.monotonic() - t0, 1)})
    if states is not None and not Path(states).is_file():
        np.savez(states, **saved)
    head = MtpHead(config, *_frozen(model))
    if init is not None:
        head.load_hf_tensors(load_file(str(Path(init) / "model.safetensors")))
        earlier = Path(init).parent / "mtp_log.json"  # the run that made it, kept in this log
        log_before = json.loads(earlier.read_text()) if earlier.is_file() else None
    params = [p for p in head.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(seed)
    train_set, held = splits["train"], splits["heldout"]
    k = config["num_experts_per_tok"]
    aux_coef = config.get("router_aux_loss_coef", 0.01)
    log = {"model": str(model_dir), "data": str(data), "seed": seed, "batch": batch, "lr": lr,
           "budget": {"steps": steps, "minutes": minutes}, "init": None if init is None else
           str(init),
           "context": context, "windows": {s: int(v[0].shape[0]) for s, v in splits.items()},
           "parameters": n_params, "torch_threads": torch.get_num_threads(),
           "curve": [], "evals": []}
    if init is not None:
        log["continued_from"] = log_before

    def heldout() -> dict:
        head.eval()
        with torch.no_grad():
            rows = [mtp_loss(head, *(a[i:i + batch] for a in held), k, aux_coef)
                    for i in range(0, held[0].shape[0], batch)]
        head.train()
        return {"loss": round(float(np.mean([r[0].item() for r in rows])), 4),
                "agree": round(float(np.mean([r[2].item() for r in rows])), 4)}

    n_steps = steps or 10 ** 9
    step, t_train = 0, time.monotonic()
    t_said = t_train
    deadline = t_start + 60 * (minutes or 0) - 60  # the held-out pass and the files after
    while step < n_steps:
        if steps is None and step >= 5:
            # --minutes alone: the schedule follows the clock, its length the steps the pace so
            # far fits before the deadline, so the cosine ends there however the load varies (a
            # fixed count from the first steps' pace stopped one run at half its schedule: the
            # 2-core machine's step went from 3.5 to 9 s as others' jobs came)
            done = (time.monotonic() - t_train) / max(1e-3, deadline - t_train)
            if done >= 1:
                break
            n_steps = max(step + 1, int(step / done))
        pick = torch.randint(0, train_set[0].shape[0], (batch,), generator=generator)
        ce, aux, agree = mtp_loss(head, *(a[pick] for a in train_set), k, aux_coef)
        warmup = min(50, max(1, n_steps // 20)) if steps else 50
        rate = lr_at(step, n_steps, lr, warmup)
        for group in optimizer.param_groups:
            group["lr"] = rate
        optimizer.zero_grad(set_to_none=True)
        (ce + aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        if step % 20 == 0 or step == 1 or step == n_steps or \
                time.monotonic() - t_said > PROGRESS_S:
            t_said = time.monotonic()
            record = {"step": step, "loss": round(ce.item(), 4), "aux": round(aux.item(), 4),
                      "agree": round(agree.item(), 4), "lr": round(rate, 6),
                      "elapsed_s": round(time.monotonic() - t_start, 1)}
            log["curve"].append(record)
            say(record)
        if steps is not None and minutes is not None and \
                time.monotonic() - t_start > 60 * minutes - 30:
            say({"stopped": "wall-clock budget", "step": step})
            break
    log["steps_done"] = step
    if steps is None:
        log["schedule"] = {"by": "wall clock", "steps": step,
                           "step_s": round((time.monotonic() - t_train) / max(1, step), 3)}
    log["evals"].append({"step": step, **heldout()})
    say({"heldout": log["evals"][-1]})
    log["train_s"] = round(time.monotonic() - t_start, 1)
    (out / "head").mkdir(parents=True, exist_ok=True)
    save_file(head.hf_tensors(), str(out / "head" / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "mtp_log.json").write_text(json.dumps(log, indent=1) + "\n")
    return log


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m training.train",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True,
                        help="corpus and tokenizer from python -m training.corpus")
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps")
    parser.add_argument("--minutes", type=float, default=None,
                        help="wall-clock budget; without --steps it also sets the step count")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--evals", type=int, default=10, help="held-out evaluations in the run")
    parser.add_argument("--eval-tokens", type=int, default=1 << 17,
                        help="held-out tokens per evaluation (at most the whole split)")
    parser.add_argument("--max-epochs", type=float, default=None,
                        help="with --minutes alone: at most this many passes over train.txt "
                             "(default: the preset's)")
    parser.add_argument("--experts", choices=EXPERTS_IMPLEMENTATIONS, default="grouped_mm",
                        help="transformers' routed-expert kernel (same function, other speed)")
    parser.add_argument("--routing", choices=sorted(ROUTINGS), default="default",
                        help="experts, top-k and balancing loss: the default model's, or the "
                             "real checkpoint's (256 experts, top-8, transformers' loss at 0.001)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if present)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--mtp-for", type=Path, default=None, metavar="MODEL",
                        help="train an MTP head for the converted fermijit MODEL instead (frozen; "
                             "issue 32): OUT gets head/ (its tensors), mtp_log.json and model/ "
                             "(MODEL with the head)")
    parser.add_argument("--mtp-windows", type=int, default=MTP_WINDOWS,
                        help="with --mtp-for: training windows of 512 tokens")
    parser.add_argument("--mtp-states", type=Path, default=None,
                        help="with --mtp-for: the model's states in this .npz (made once)")
    parser.add_argument("--mtp-init", type=Path, default=None,
                        help="with --mtp-for: continue from this head directory (OUT/head)")
    parser.add_argument("--mtp-lr", type=float, default=1e-3,
                        help="with --mtp-for: peak learning rate (AdamW, batch 8)")
    args = parser.parse_args(argv)
    if args.steps is None and args.minutes is None:
        parser.error("give --steps, --minutes or both")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} exists and is not empty")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mtp_for is not None:
        from fermijit.model.convert import add_mtp_head

        train_mtp(args.mtp_for, args.data, args.out, args.steps, args.minutes, seed=args.seed,
                  lr=args.mtp_lr, n_windows=args.mtp_windows, states=args.mtp_states,
                  init=args.mtp_init)
        add_mtp_head(args.mtp_for, args.out / "head", args.out / "model")
        shutil.copyfile(args.out / "mtp_log.json", args.out / "model" / "mtp_log.json")
        print(json.dumps({"saved": str(args.out / "model")}), flush=True)
        return
    train(args.data, args.out, PRESETS[args.preset], args.steps, args.minutes, seed=args.seed,
          evals=args.evals, eval_tokens=args.eval_tokens, device=args.device,
          max_epochs=args.max_epochs, experts=args.experts, routing=ROUTINGS[args.routing]())


if __name__ == "__main__":
    sys.exit(main())
