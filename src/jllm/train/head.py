"""Train an EAGLE-3 head for a GGUF target and write it as llama.cpp's eagle3 GGUF, end to end:

    python -m jllm.train.head -m TARGET.gguf -o HEAD.gguf --device cuda [--data DATA.npz]

1. data (data.py): Magpie user turns and prompts made from installed packages' files, the target's own
   replies; saved to --data (token ids, a few MB) and reused when that file exists.
2. the target (target.py) on the device: for each training batch, its three layers' inputs and its logits.
3. training (eagle3.py): AdamW, warm-up then cosine decay, the TTT loss over --ttt unrolled steps.
4. the GGUF (export.py), quantized to --qtype.
Prints each phase's time and the training curve (per step loss and top-1 agreement with the target).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from jllm.catalog import resolve
from jllm.errors import JllmError
from jllm.paths import check_writable
from jllm.train import data as data_mod
from jllm.train.eagle3 import Eagle3Head, HeadConfig, reply_rows
from jllm.train.export import file_bytes, write_head
from jllm.train.target import Target, load_target


@dataclass
class TrainConfig:
    steps: int = 2000
    lr: float = 3e-4
    warmup: int = 100
    batch_tokens: int = 16384        # padded tokens per batch (B * T)
    max_len: int = 2048              # conversations are cut to this many tokens
    ttt: int = 7                     # unrolled draft steps
    decay: float = 0.8               # loss weight of step j: decay ** j
    clip: float = 0.5
    seed: int = 0
    log_every: int = 50
    holdout: float = 0.0             # share of conversations kept out of training, to measure the head on
    holdout_batches: int = 8         # of them, at most this many batches are scored at each log line
    time_limit: float | None = None  # seconds at most: the schedule then ends with the time, decayed, if first
    profile: int = 0                 # steps to run under torch's profiler after the first (0: none): its table
    compile: bool = False            # the head's unrolled step through torch.compile (fused elementwise work)

    def __post_init__(self):
        """The settings' bounds, said in train-head's flags (which this is built from: train_config)."""
        for flag, value, least in (("--steps", self.steps, 1), ("--ttt", self.ttt, 1), ("--max-len", self.max_len, 1),
                                   ("--profile", self.profile, 0)):
            if value < least:
                raise JllmError(f"{flag} must be at least {least} (got {value})")
        if self.batch_tokens < self.max_len:
            raise JllmError(f"--batch-tokens ({self.batch_tokens}) must hold one conversation of --max-len "
                            f"({self.max_len})")
        if not self.lr > 0:
            raise JllmError(f"--lr must be above 0 (got {self.lr})")
        if not 0.0 <= self.holdout <= 0.5:
            raise JllmError(f"--holdout must be between 0 and 0.5 (got {self.holdout})")
        if self.time_limit is not None and not self.time_limit > 0:
            raise JllmError(f"--train-time must be above 0 seconds (got {self.time_limit})")


def train_config(a) -> TrainConfig:
    """train-head's arguments -> the training's settings (checked by TrainConfig itself)."""
    return TrainConfig(steps=a.steps, lr=a.lr, batch_tokens=a.batch_tokens, max_len=a.max_len, ttt=a.ttt,
                       seed=a.seed, holdout=a.holdout, time_limit=a.train_time, profile=a.profile,
                       compile=a.compile)


@dataclass
class History:
    loss: list[float] = field(default_factory=list)          # weighted TTT loss per optimizer step
    step_loss: list[list[float]] = field(default_factory=list)
    step_acc: list[list[float]] = field(default_factory=list)
    tokens: int = 0
    target_s: float = 0.0
    head_s: float = 0.0
    held_acc: list[tuple[int, list[float]]] = field(default_factory=list)   # (step, agreement per draft step)


def make_batches(conv: data_mod.Conversations, max_len: int, batch_tokens: int,
                 indices=None) -> list[list[int]]:
    """Conversation indices (all, or `indices`) grouped by length so that B * (longest) <= batch_tokens."""
    lengths = np.minimum(conv.offsets[1:] - conv.offsets[:-1], max_len)
    pool = np.arange(len(conv)) if indices is None else np.asarray(sorted(indices))
    order = pool[np.argsort(lengths[pool], kind="stable")]
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * int(lengths[i]) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(int(i))
    if cur:
        batches.append(cur)
    return batches


def spread(batches: list, n: int) -> list:
    """n of the batches (sorted by length), evenly spaced from the shortest to the longest: the held-out
    score is then one of every length, not of the longest conversations (mostly code) alone."""
    if len(batches) <= n:
        return batches
    return [batches[round(i * (len(batches) - 1) / (n - 1))] for i in range(n)] if n > 1 else batches[-1:]


def collate(conv: data_mod.Conversations, idx: list[int], max_len: int, pad: int, device):
    """-> ids [B, T] right-padded with `pad`, lengths [B], reply_start [B], on `device`."""
    rows = [conv.ids(i)[:max_len] for i in idx]
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.from_numpy(r.astype(np.int64))
    lengths = torch.tensor([len(r) for r in rows])
    starts = torch.tensor([int(conv.reply_start[i]) for i in idx])
    return ids.to(device), lengths.to(device), starts.to(device)


def target_pass(target: Target, head: Eagle3Head, ids, lengths, starts, d2t):
    """What the head learns from, for a batch: the target's layer inputs [B, T, 3 Dt], the rows it is scored
    at (eagle3.reply_rows: (b, t0), R of them), and at each the target's prediction of its reply token (position
    t0 + 1): logits over the draft vocabulary [R, Vd] and the top token over the whole vocabulary [R]. The
    target's output matrix runs over those R positions only (the full logits freed)."""
    b, t0 = rows = reply_rows(lengths, starts, ids.shape[1])
    feats, logits = target.features(ids, lengths, head.c.target_layers, rows=(b, t0 + 1))
    top = logits.argmax(-1)
    tl = logits[:, d2t]
    del logits
    return feats, tl, top, rows


def new_head(target: Target, d2t: np.ndarray, ffn: int | None, layers=None) -> Eagle3Head:
    c = HeadConfig.for_target(target.cfg, len(d2t), ffn, layers)
    head = Eagle3Head(c, target.embedding)
    head.init_from_target(target.lm_head, target.final_norm, torch.from_numpy(d2t))
    return head.to(target.device)


def progress(step: int, steps: int, elapsed: float, time_limit: float | None) -> float:
    """How far training is, 0..1: by steps, or by time where a time limit would end it first. The learning
    rate's decay follows it, so a run the clock ends still ends at its low rate, not mid-schedule."""
    p = step / steps
    return min(1.0, p if time_limit is None else max(p, elapsed / time_limit))


def lr_factor(step: int, warm: int, prog: float) -> float:
    """Linear warm-up over `warm` steps, then cosine from 1.0 down to 0.1 over the progress."""
    return min(1.0, (step + 1) / warm) * (0.1 + 0.45 * (1 + math.cos(math.pi * prog)))


@torch.no_grad()
def init_from_head(head: Eagle3Head, path) -> int:
    """Start from a head file's weights (dequantized) instead of random ones: a new run goes on from an old
    one. Its shape must be this head's (hidden size, FFN width, heads, target layers and hidden size); its
    draft vocabulary may differ: a row of this head's output whose target id the file's d2t also has takes the
    file's row, the others keep the target's (init_from_target; the output norm is the file's for all rows).
    Only shapes are checked: the file must be a head for this target. -> how many output rows came from it."""
    from jllm.eagle3 import format as fmt
    from jllm.gguf.quants import dequantize
    from jllm.gguf.reader import read_gguf
    from jllm.train.export import head_params

    g = read_gguf(path)
    old = fmt.read_head_config(g)
    c = head.c
    for what in ("hidden", "ffn", "n_heads", "n_kv_heads", "head_dim", "target_hidden", "target_layers"):
        if getattr(old, what) != getattr(c, what):
            raise JllmError(f"--init {Path(path).name}: its {what} is {getattr(old, what)}, this head's "
                            f"{getattr(c, what)}")
    if not old.own_output:
        raise JllmError(f"--init {Path(path).name}: it has no output layer of its own")
    if old.norm_before_fc or old.norm_before_residual:
        raise JllmError(f"--init {Path(path).name}: it norms before fc or the residual, which this head does not")

    def weight(name):
        t = g.tensors[name]
        return dequantize(g.raw(name), t.ggml_type, t.shape)                  # float32, [out, in]

    for name, p in head_params(head).items():
        if name == fmt.OUTPUT:
            continue
        w = weight(name)
        if tuple(w.shape) != tuple(p.shape):
            raise JllmError(f"--init {Path(path).name}: {name} is {list(w.shape)}, this head's {list(p.shape)}")
        p.copy_(w.to(p))
    old_d2t = fmt.read_d2t(g)
    old_ids = np.arange(old.draft_vocab) if old_d2t is None else old_d2t.cpu().numpy()
    row_of = {int(t): r for r, t in enumerate(old_ids)}
    new_ids = head.d2t.cpu().numpy()
    mine = [r for r, t in enumerate(new_ids) if int(t) in row_of]
    if mine:
        out = weight(fmt.OUTPUT)
        src = torch.tensor([row_of[int(new_ids[r])] for r in mine])
        head.lm_head.weight[torch.tensor(mine, device=head.lm_head.weight.device)] = \
            out[src].to(head.lm_head.weight)
    return len(mine)


def train(target: Target, head: Eagle3Head, conv: data_mod.Conversations, tc: TrainConfig,
          log=print, checkpoint=None) -> History:
    """`checkpoint(head)`, if given, is called after each held-out score (the head then in eval mode)."""
    dev = target.device
    rng = random.Random(tc.seed)
    held = set(random.Random(tc.seed + 1).sample(range(len(conv)), int(len(conv) * tc.holdout)))
    batches = make_batches(conv, tc.max_len, tc.batch_tokens, [i for i in range(len(conv)) if i not in held])
    held_batches = spread(make_batches(conv, tc.max_len, tc.batch_tokens, held), tc.holdout_batches) if held else []
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm = min(tc.warmup, max(1, tc.steps // 10))
    pad = target.tokenizer.eos_id or 0
    d2t = head.d2t.to(dev)
    hist = History()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast(
        "cpu", enabled=False)

    def score(step):
        held_acc = evaluate(target, head, conv, held_batches, tc, pad, d2t, autocast)
        hist.held_acc.append((step, held_acc))
        log(f"step {step}: held-out agreement per draft step {' '.join(f'{a:.2f}' for a in held_acc)} "
            f"({len(held)} conversations kept out)")

    if tc.compile:
        # the step's norms, RoPE, GLU and residuals were ~2/5 of a training step's GPU time as separate kernels
        # (training/README.md, the profile); compiled, they fuse. Same parameters, so the head is written as ever
        head.block = torch.compile(head.block, dynamic=True)
    head.train()
    order: list[int] = []
    prof, profiled = None, 0
    t_start = time.perf_counter()
    for step in range(tc.steps):
        if tc.profile and step == 1:                # the first step compiles and allocates: not profiled
            prof = _profiler(dev)
            prof.start()
        if prof is not None and profiled == tc.profile:
            log(_profile_table(prof, dev, profiled))
            prof = None
        prog = progress(step, tc.steps, time.perf_counter() - t_start, tc.time_limit)
        if prog >= 1.0:
            log(f"step {step}/{tc.steps}: the time limit of {tc.time_limit:.0f} s ends training")
            if held_batches and not (hist.held_acc and hist.held_acc[-1][0] == step):    # not scored yet
                score(step)
            break
        for g in opt.param_groups:
            g["lr"] = tc.lr * lr_factor(step, warm, prog)
        if not order:
            order = list(range(len(batches)))
            rng.shuffle(order)
        ids, lengths, starts = collate(conv, batches[order.pop()], tc.max_len, pad, dev)
        t0 = time.perf_counter()
        feats, tl, top, rows = target_pass(target, head, ids, lengths, starts, d2t)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        with autocast:
            loss, losses, accs = head.ttt(feats, ids, lengths, starts, tl, top, tc.ttt, tc.decay, rows=rows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, tc.clip)
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        hist.loss.append(loss.item())
        hist.step_loss.append(losses)
        hist.step_acc.append(accs)
        hist.tokens += int(lengths.sum())
        hist.target_s += t1 - t0
        hist.head_s += t2 - t1
        if step == 0:                               # the first step compiles and allocates: the rate after it
            first_tokens, after_first = hist.tokens, time.perf_counter()
        profiled += prof is not None
        if (step + 1) % tc.log_every == 0 or step == 0 or step + 1 == tc.steps:
            k = min(tc.log_every, len(hist.loss))
            acc = np.mean(hist.step_acc[-k:], axis=0)
            now = time.perf_counter()
            steady = f", {(hist.tokens - first_tokens) / (now - after_first):.0f} after the first step" if step else ""
            log(f"step {step + 1}/{tc.steps}: loss {np.mean(hist.loss[-k:]):.3f}, agreement per draft step "
                f"{' '.join(f'{a:.2f}' for a in acc)}, {hist.tokens / (now - t_start):.0f} "
                f"tok/s{steady} (target {hist.target_s:.1f} s, head {hist.head_s:.1f} s)")
            if held_batches and ((step + 1) % (4 * tc.log_every) == 0 or step + 1 == tc.steps):
                score(step + 1)
                if checkpoint is not None:
                    head.eval()
                    checkpoint(head)
                    head.train()
    if prof is not None:                            # training ended inside the profiled steps
        log(_profile_table(prof, dev, profiled))
    head.eval()
    return hist


def _profiler(dev: torch.device):
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else []))


def _profile_table(prof, dev: torch.device, steps: int) -> str:
    """Where `steps` training steps' time went, the 30 largest operators by their own time on the device (the
    CPU's where there is no GPU): what to make faster in a lease's training (the target's pass, the head's
    layers and attention, the loss over the draft vocabulary, the optimizer)."""
    prof.stop()
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    return f"profile of {steps} training steps:\n" + prof.key_averages().table(sort_by=key, row_limit=30)


@torch.no_grad()
def evaluate(target: Target, head: Eagle3Head, conv, batches, tc: TrainConfig, pad: int, d2t, autocast) -> list[float]:
    """The head's top-1 agreement with the target at each draft step over `batches` (reply positions,
    weighted by their count), in eval mode, restoring training mode after."""
    head.eval()
    hits = np.zeros(tc.ttt)
    count = 0
    for idx in batches:
        ids, lengths, starts = collate(conv, idx, tc.max_len, pad, target.device)
        feats, tl, top, rows = target_pass(target, head, ids, lengths, starts, d2t)
        with autocast:
            _, _, accs = head.ttt(feats, ids, lengths, starts, tl, top, tc.ttt, tc.decay, rows=rows)
        n = len(rows[0])                                         # the reply positions scored
        hits += np.asarray(accs) * n
        count += n
    head.train()
    return (hits / max(count, 1)).tolist()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jllm train-head", description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True, help="the target: an alias (jllm models) or a GGUF file")
    ap.add_argument("-o", "--out", required=True, help="the head GGUF to write")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--data", help="the conversations' .npz: read if it exists, else made and saved there; "
                    "several files, comma-separated, are read and trained on together")
    ap.add_argument("--data-only", action="store_true", help="make the data, train nothing")
    ap.add_argument("--magpie", type=int, default=3000, help="conversations with a Magpie user turn")
    ap.add_argument("--package", type=int, default=3000, help="conversations over installed packages' files")
    ap.add_argument("--writing", type=int, default=3000, help="texts the target writes (kind x topic), each "
                    "then given back with a prose task, and its translations back into English")
    ap.add_argument("--questions", type=int, default=3000, help="questions on how something works "
                    "(beyond code), each answer also given back with a prose task")
    ap.add_argument("--requests", type=int, default=3000, help="requests of several parts that the target "
                    "writes itself about a topic, then answers (each answer also given back with a prose task)")
    ap.add_argument("--follow-up", type=float, default=0.3, help="share of the first round's finished replies "
                    "that get a second user turn and a second reply")
    ap.add_argument("--max-new", type=int, default=512, help="reply tokens at most")
    ap.add_argument("--gen-batch", type=int, default=128, help="prompts generated at once")
    ap.add_argument("--gen-time", type=float, default=None, help="seconds at most for generating the replies")
    ap.add_argument("--sampled", type=float, default=0.5, help="fraction of replies sampled (else greedy)")
    ap.add_argument("--draft-vocab", type=int, default=24576)
    # 24576 x 1536 output rows and FFN 2304 in Q4_0 with the 1.5B's tokenizer: 39.7 MB (FFN 3840: 43.6 MB,
    # measured on the H200 smoke run); each 256 of FFN width is 0.66 MB, each 1024 draft rows 0.88 MB
    ap.add_argument("--ffn", type=int, default=2304, help="the head's FFN width (the file size budget)")
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--lr", type=float, default=TrainConfig.lr)
    ap.add_argument("--batch-tokens", type=int, default=TrainConfig.batch_tokens)
    ap.add_argument("--max-len", type=int, default=TrainConfig.max_len)
    ap.add_argument("--train-time", type=float, default=None, help="seconds at most for training: the "
                    "learning rate then decays over the time, if it ends training before --steps")
    ap.add_argument("--checkpoint", action="store_true", help="write the head to --out at each held-out "
                    "score too (a run cut short still leaves a head; needs --holdout > 0)")
    ap.add_argument("--init", help="a head GGUF to start from (same shape; its output rows are mapped "
                    "through both draft vocabularies)")
    ap.add_argument("--ttt", type=int, default=TrainConfig.ttt, help="unrolled draft steps")
    ap.add_argument("--qtype", default="Q4_0", help="matrix type in the file (Q4_0, Q8_0, F16, ...)")
    ap.add_argument("--holdout", type=float, default=0.02, help="share of conversations kept out of training "
                    "and scored every 4 log lines (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", type=int, default=0, help="run this many training steps (after the first) "
                    "under torch's profiler and print where their time went")
    ap.add_argument("--compile", action="store_true", help="the head's step through torch.compile (its first "
                    "steps then compile; on a GPU its elementwise work fuses)")
    a = ap.parse_args(argv)
    try:
        return _run(a)
    except JllmError as e:
        print(f"jllm train-head: {e}", file=sys.stderr)
        return 1


def _write_whole(out: str, head: Eagle3Head, model: str, qtype) -> int:
    """The head written next to `out` and renamed over it: a reader (a poll copying it off a lent machine)
    never sees half a file. -> its size."""
    tmp = f"{out}.part"
    size = write_head(tmp, head, model, qtype)
    Path(tmp).replace(out)
    return size


def _checkpoint(out: str, head: Eagle3Head, model: str, qtype) -> None:
    _write_whole(out, head, model, qtype)
    print(f"checkpoint: {out}")


def _writable(path: str, what: str) -> None:
    """Fail now, not after an hour of work, where `path` cannot be written."""
    try:
        check_writable(path)
    except OSError as e:
        raise JllmError(f"cannot write {what} {path}: {e.strerror or e}") from None


def _check_args(a) -> "gguf.GGMLQuantizationType":
    """Everything about the arguments that can be known before the target loads -> the file's matrix type."""
    from jllm.train.export import QUANTIZABLE

    train_config(a)                               # the training's own settings (TrainConfig's checks)
    for flag, value, least in (("--draft-vocab", a.draft_vocab, 1), ("--ffn", a.ffn, 1), ("--max-new", a.max_new, 1),
                               ("--gen-batch", a.gen_batch, 1), ("--magpie", a.magpie, 0),
                               ("--package", a.package, 0), ("--writing", a.writing, 0),
                               ("--questions", a.questions, 0), ("--requests", a.requests, 0)):
        if value < least:
            raise JllmError(f"{flag} must be at least {least} (got {value})")
    for flag, value in (("--follow-up", a.follow_up), ("--sampled", a.sampled)):
        if not 0.0 <= value <= 1.0:
            raise JllmError(f"{flag} must be between 0 and 1 (got {value})")
    if a.gen_time is not None and not a.gen_time > 0:
        raise JllmError(f"--gen-time must be above 0 seconds (got {a.gen_time})")
    if a.checkpoint and not a.holdout:
        raise JllmError("--checkpoint writes the head at each held-out score: it needs --holdout > 0")
    qtype = next((q for q in QUANTIZABLE if q.name == a.qtype.upper()), None)
    if qtype is None:
        raise JllmError(f"--qtype {a.qtype}: not one of {', '.join(q.name for q in QUANTIZABLE)}")
    if not a.data_only:
        _writable(a.out, "the head")
    files = a.data.split(",") if a.data else []
    if len(files) == 1 and not Path(files[0]).exists():
        _writable(files[0], "the training data")                 # made, then saved there
    if a.init and not Path(a.init).is_file():
        raise JllmError(f"--init {a.init}: no such file")
    return qtype


def _run(a) -> int:
    t0 = time.perf_counter()
    qtype = _check_args(a)
    a.model = str(resolve(a.model))
    target = load_target(a.model, a.device)
    print(f"target: {Path(a.model).name}, {target.cfg.n_layers} layers, hidden {target.cfg.hidden}, "
          f"on {a.device} ({time.perf_counter() - t0:.1f} s)")
    fp = target.tokenizer.fingerprint()
    files = a.data.split(",") if a.data else []
    if len(files) > 1 or (files and Path(files[0]).exists()):
        missing = [f for f in files if not Path(f).exists()]
        if missing:
            raise JllmError(f"no training data at {', '.join(missing)} (several --data files are read, not made)")
        conv = data_mod.Conversations.concat([data_mod.Conversations.load(f, fp) for f in files])
        print(f"data: {a.data}: {len(conv)} conversations, {conv.reply_tokens()} reply tokens")
    else:
        conv = data_mod.generate(target, a.magpie, a.package, a.max_new, a.gen_batch, sampled_frac=a.sampled,
                                 seed=a.seed, time_limit=a.gen_time, n_writing=a.writing,
                                 follow_share=a.follow_up, n_questions=a.questions, n_requests=a.requests)
        if a.data:
            conv.save(a.data)
    if a.data_only:
        return 0
    d2t = data_mod.draft_vocab(conv, target.cfg.vocab_size, a.draft_vocab, always=target.tokenizer.eot_ids)
    head = new_head(target, d2t, a.ffn)
    if a.init:
        rows = init_from_head(head, a.init)
        print(f"head: starts from {a.init} ({rows} of its {len(d2t)} output rows from it, the rest the target's)")
    print(f"head: draft vocabulary {len(d2t)}, ffn {head.c.ffn}, layers {list(head.c.target_layers)}, "
          f"~{file_bytes(head, qtype) / 2**20:.1f} MiB of tensors in {qtype.name}")
    tc = train_config(a)
    t1 = time.perf_counter()
    hist = train(target, head, conv, tc, checkpoint=(lambda h: _checkpoint(a.out, h, a.model, qtype))
                 if a.checkpoint else None)
    size = _write_whole(a.out, head, a.model, qtype)
    peak = f", peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if target.device.type == "cuda" else ""
    print(f"wrote {a.out}: {size / 2**20:.1f} MiB; training {time.perf_counter() - t1:.0f} s for "
          f"{hist.tokens} tokens ({hist.target_s:.0f} s target, {hist.head_s:.0f} s head){peak}; "
          f"all {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
