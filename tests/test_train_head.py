"""jllm.train: a tiny EAGLE-3 head trained on a tiny synthetic target, end to end, on the CPU."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch

from synthetic import write_tiny_model

from jllm.errors import JllmError
from jllm.eagle3 import format as fmt
from jllm.gguf.reader import read_gguf
from jllm.model.config import config_from_gguf
from jllm.train import data as data_mod
from jllm.train.eagle3 import Eagle3Head, HeadConfig, reply_rows, rope_interleaved
from jllm.train.export import write_head
from jllm.train.head import TrainConfig, lr_factor, make_batches, new_head, progress, spread, train
from jllm.train.target import load_target

pytestmark = pytest.mark.usefixtures("native_kernels")      # built before the first model runs

SNIPPET = '''def merge(a, b):
    """Merge two sorted lists into one sorted list."""
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out
'''


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one torch thread is fastest, and several crawl when the machine is busy."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def target(tmp_path_factory, one_thread):
    d = tmp_path_factory.mktemp("train")
    ref = write_tiny_model(d / "target.gguf", "qwen2", num_hidden_layers=8, max_position_embeddings=2048)
    return load_target(str(d / "target.gguf")), ref, d


def test_target_matches_jllm_and_the_oracle(target):
    """The training target computes what jllm's exact path computes; its features are HF's layer inputs."""
    from jllm.model.loader import load_model

    tg, ref, d = target
    ids = [5, 17, 250, 40, 41, 3, 99, 120]
    jm = load_model(d / "target.gguf", precision="exact", cache_weights=False)
    want = jm.forward(torch.tensor(ids), jm.new_cache(16))
    feats, logits = tg.features(torch.tensor([ids]), torch.tensor([len(ids)]), (2, 4, 5))
    assert (logits[0] - want).abs().max() < 1e-3
    # the output matrix over chosen positions only: their rows of the whole logits (up to the matmul's rounding)
    rows = (torch.tensor([0, 0, 0]), torch.tensor([1, 4, 7]))
    _, some = tg.features(torch.tensor([ids]), torch.tensor([len(ids)]), (2, 4, 5), rows=rows)
    assert some.shape == (3, tg.cfg.vocab_size) and torch.allclose(some, logits[0, [1, 4, 7]], atol=1e-5)
    hs = ref.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    D = tg.cfg.hidden
    for k, layer in enumerate((2, 4, 5)):
        assert torch.allclose(feats[0, :, k * D:(k + 1) * D], hs[layer][0], atol=1e-4)


def test_package_prompts_and_data_roundtrip(target, tmp_path):
    tg, _, _ = target
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "merge.py").write_text(SNIPPET)
    (tmp_path / "lib" / "README.md").write_text("# merge\n\n" + "Merges sorted lists in linear time.\n" * 14)
    files = data_mod.package_files([str(tmp_path / "lib")])
    assert sorted(f.name for f in files) == ["README.md", "merge.py"]
    prompts = data_mod.package_prompts(6, __import__("random").Random(0), files)
    assert len(prompts) == 6 and all(("merge" in p or "Merges" in p) for p in prompts)
    # the docs also become prose tasks (translation into a human language among them), with no {field} left
    many = data_mod.package_prompts(200, __import__("random").Random(1), files)
    assert any(p.startswith("Translate this text into ") for p in many)
    assert not any("{" in p.split("\n")[0] for p in many)
    prefix = data_mod.user_prefix(tg.template, tg.tokenizer)
    assert tg.tokenizer.decode(prefix) == "<|im_start|>user\n"
    conv = data_mod.generate(tg, 2, 4, max_new=12, batch=4, user_max_new=8, files=files, log=lambda s: None)
    assert len(conv) >= 4 and conv.reply_tokens() > 0
    conv.save(tmp_path / "d.npz")
    back = data_mod.Conversations.load(tmp_path / "d.npz", tg.tokenizer.fingerprint())
    assert np.array_equal(back.tokens, conv.tokens) and np.array_equal(back.reply_start, conv.reply_start)
    with pytest.raises(Exception, match="another tokenizer"):
        data_mod.Conversations.load(tmp_path / "d.npz", "0" * 64)
    both = data_mod.Conversations.concat([conv, back])          # two files trained on together
    assert len(both) == 2 * len(conv) and both.reply_tokens() == 2 * conv.reply_tokens()
    assert all(np.array_equal(both.ids(len(conv) + i), conv.ids(i)) for i in range(len(conv)))
    d2t = data_mod.draft_vocab(conv, tg.cfg.vocab_size, 40, always=tg.tokenizer.eot_ids)
    assert len(d2t) == 40 and np.all(np.diff(d2t) > 0) and set(tg.tokenizer.eot_ids) <= set(d2t.tolist())


def _reference_chain(head: Eagle3Head, g0: torch.Tensor, ids: torch.Tensor, t: int, steps: int) -> list:
    """The head run row by row as llama.cpp drafts: rows 0..t are (token s+1, fc(feats s)) at position s,
    then each drafted row at t + j is (token t+1+j, the previous row's h): plain causal attention over
    every row so far. -> the h of rows t, t+1, ..., t+steps-1."""
    c = head.c
    rows = [(int(ids[s + 1]), g0[s], s) for s in range(t + 1)]
    K, V, out = [], [], []
    for j in range(steps):
        if j:
            rows.append((int(ids[t + 1 + j]), out[-1], t + j))
        K, V = [], []
        for tok, g, p in rows:                      # recompute every row (the cache, written out)
            e = head.embed[tok]
            x = torch.cat([head._norm(e, head.attn_norm), head._norm(g, head.hidden_norm)])
            k = rope_interleaved(head.k(x).view(1, 1, c.n_kv_heads, c.head_dim), torch.tensor([p]), c.rope_base)
            K.append(k[0, 0])
            V.append(head.v(x).view(c.n_kv_heads, c.head_dim))
        tok, g, p = rows[-1]
        x = torch.cat([head._norm(head.embed[tok], head.attn_norm), head._norm(g, head.hidden_norm)])
        q = rope_interleaved(head.q(x).view(1, 1, c.n_heads, c.head_dim), torch.tensor([p]), c.rope_base)[0, 0]
        Kt, Vt = torch.stack(K), torch.stack(V)                          # [rows, Hk, hd]
        rep = c.n_heads // c.n_kv_heads
        a = []
        for hh in range(c.n_heads):
            w = torch.softmax(Kt[:, hh // rep] @ q[hh] / math.sqrt(c.head_dim), dim=0)
            a.append(w @ Vt[:, hh // rep])
        h = g + head.o(torch.cat(a))
        n = head._norm(h, head.ffn_norm)
        out.append(h + head.down(torch.nn.functional.silu(head.gate(n)) * head.up(n)))
    return out


def test_ttt_equals_drafting_row_by_row(target):
    """Each TTT step's state at position t is what the head computes when it drafts that row at run time."""
    tg, _, _ = target
    torch.manual_seed(0)
    c = HeadConfig.for_target(tg.cfg, 32, ffn=96, layers=(2, 4, 5))
    head = Eagle3Head(c, tg.embedding)
    ids = torch.randint(0, 290, (1, 14))
    feats = torch.randn(1, 14, 3 * c.target_hidden)
    with torch.no_grad():
        hs = list(head.unroll(feats, ids, 4))
        g0 = head.fc(feats[0])
        for t in (0, 3, 8):
            want = _reference_chain(head, g0, ids[0], t, 4)
            for j in range(4):
                assert torch.allclose(hs[j][0, t], want[j], atol=1e-4), (t, j)


def _reference_ttt(head, feats, ids, lengths, reply_start, target_logits, target_top, steps, decay):
    """The TTT loss written out the plain way: every step's targets shifted into place over all rows."""
    from jllm.train.eagle3 import shift_left

    t2d = torch.zeros(head.c.target_vocab, dtype=torch.bool)
    t2d[head.d2t] = True
    pos = torch.arange(ids.shape[1])
    total, losses, accs = torch.zeros(()), [], []
    for j, h in enumerate(head.unroll(feats, ids, steps)):
        logp = torch.log_softmax(head.logits(h).float(), dim=-1)
        pred = pos[None, :] + 2 + j
        reply = (pred < lengths[:, None]) & (pred >= reply_start[:, None])
        top = shift_left(target_top, 1 + j)
        mask = reply & t2d[top]
        p = torch.softmax(shift_left(target_logits, 1 + j).float(), dim=-1)
        loss = (-(p * logp).sum(-1) * mask).sum() / mask.sum().clamp(min=1)
        total = total + decay ** j * loss
        hit = (head.d2t[logp.argmax(-1)] == top) & reply
        losses.append(loss.item())
        accs.append(hit.sum().item() / max(reply.sum().item(), 1))
    return total, losses, accs


def test_ttt_loss_equals_the_plain_formula(target):
    """The TTT loss, its gradients, and each step's loss and agreement are those of the plain formula (the
    trainer gathers the rows whose token is a reply token and scores only those)."""
    tg, _, _ = target
    torch.manual_seed(0)
    c = HeadConfig.for_target(tg.cfg, 48, ffn=96, layers=(2, 4, 5))
    head = Eagle3Head(c, tg.embedding)
    head.d2t.copy_(torch.randperm(c.target_vocab)[:48])
    B, T = 3, 12
    ids = torch.randint(0, 290, (B, T))
    feats = torch.randn(B, T, 3 * c.target_hidden)
    lengths, starts = torch.tensor([12, 9, 5]), torch.tensor([2, 4, 0])
    tl = torch.randn(B, T, 48) * 3
    top = head.d2t[tl.argmax(-1)]
    top[0, 5] = next(i for i in range(c.target_vocab) if i not in set(head.d2t.tolist()))   # not draftable
    with torch.no_grad():                                    # a head that agrees with the target now and then
        head.lm_head.weight.mul_(20)
    got = head.ttt(feats, ids, lengths, starts, tl, top, steps=14, decay=0.8)     # steps past the rows: none left
    params = [p for p in head.parameters() if p.requires_grad]
    got[0].backward()
    grads = [p.grad.clone() for p in params]
    head.zero_grad()
    want = _reference_ttt(head, feats, ids, lengths, starts, tl, top, 14, 0.8)
    want[0].backward()
    assert torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert got[1] == pytest.approx(want[1], rel=1e-5, abs=1e-6) and got[2] == pytest.approx(want[2])
    assert any(a > 0 for a in want[2])
    assert len(params) > 10 and all(g.abs().sum() > 0 for g in grads[:3])
    for g, p in zip(grads, params):
        assert torch.allclose(g, p.grad, rtol=1e-4, atol=1e-6)
    # the trainer's form: the target's logits and top token given at the reply rows only (target_pass)
    b, t0 = rows = reply_rows(lengths, starts, T)
    assert len(b) == sum(max(0, int(n) - max(int(s), 2)) for n, s in zip(lengths, starts))
    same = head.ttt(feats, ids, lengths, starts, tl[b, t0 + 1], top[b, t0 + 1], steps=14, decay=0.8, rows=rows)
    assert torch.equal(same[0], got[0]) and same[1] == got[1] and same[2] == got[2]


def test_train_loss_falls_and_the_gguf_loads(target, tmp_path):
    tg, _, d = target
    rng = __import__("random").Random(1)
    rows = []
    for i in range(6):                               # the target's own greedy replies to fixed prompts
        prompt = data_mod.chat_prompt(tg.template, tg.tokenizer, f"Hello world {i} and the {rng.random():.3f}")
        rows.append((prompt, tg.generate([prompt], 40, sample=False)[0], 1, False))
    conv = data_mod.Conversations.build(rows, dict(target="target.gguf", tokenizer=tg.tokenizer.fingerprint()))
    d2t = data_mod.draft_vocab(conv, tg.cfg.vocab_size, 64, always=tg.tokenizer.eot_ids)
    torch.manual_seed(0)
    head = new_head(tg, d2t, ffn=128)
    assert torch.equal(head.lm_head.weight, tg.lm_head[torch.from_numpy(d2t)])
    tc = TrainConfig(steps=40, lr=3e-3, warmup=4, batch_tokens=512, max_len=256, ttt=3, log_every=1000,
                     holdout=0.2)
    hist = train(tg, head, conv, tc, log=lambda s: None)
    first, last = np.mean(hist.loss[:3]), np.mean(hist.loss[-3:])
    assert last < 0.6 * first, (first, last)
    # one conversation of the six was kept out and scored at the end, per draft step
    assert [s for s, _ in hist.held_acc] == [40] and len(hist.held_acc[0][1]) == 3
    assert all(0.0 <= a <= 1.0 for a in hist.held_acc[0][1])
    assert sorted(i for b in make_batches(conv, 256, 512, [0, 3]) for i in b) == [0, 3]
    # the held-out batches scored are spread over the lengths, the shortest and the longest among them
    assert spread(list(range(20)), 8) == [0, 3, 5, 8, 11, 14, 16, 19] and spread([1, 2], 8) == [1, 2]
    assert np.mean([a[0] for a in hist.step_acc[-3:]]) > np.mean([a[0] for a in hist.step_acc[:3]])

    path = tmp_path / "head.gguf"
    write_head(path, head, str(d / "target.gguf"), gguf.GGMLQuantizationType.Q4_0)
    r = gguf.GGUFReader(path)
    assert r.fields["general.architecture"].contents() == "eagle3"
    assert r.fields[fmt.KEY_TARGET_LAYERS].contents() == list(head.c.target_layers)
    assert r.fields[fmt.KEY_TARGET_HIDDEN].contents() == tg.cfg.hidden
    t = gguf.GGUFReader(d / "target.gguf")
    assert r.fields["tokenizer.ggml.tokens"].contents() == t.fields["tokenizer.ggml.tokens"].contents()
    assert r.fields["tokenizer.chat_template"].contents() == t.fields["tokenizer.chat_template"].contents()
    tensors = {x.name: x for x in r.tensors}
    assert set(tensors) == set(fmt.REQUIRED_TENSORS) | {fmt.OUTPUT, fmt.D2T}
    assert tensors[fmt.FC].tensor_type == gguf.GGMLQuantizationType.Q4_0
    assert tensors[fmt.ATTN_NORM].tensor_type == gguf.GGMLQuantizationType.F32
    assert list(tensors[fmt.D2T].data) == d2t.tolist()

    g = read_gguf(path)                                        # jllm's reader and the format's own checks
    cfg = fmt.read_head_config(g)
    assert (cfg.hidden, cfg.ffn, cfg.draft_vocab, cfg.n_heads) == (64, 128, 64, 4)
    assert cfg.target_layers == head.c.target_layers and cfg.own_output and not cfg.own_embedding
    target_g = read_gguf(d / "target.gguf")
    fmt.check_target(cfg, g, config_from_gguf(target_g.metadata, set(target_g.tensors)), target_g,
                     fmt.read_d2t(g))
    from jllm.gguf.quants import dequantize
    w = dequantize(g.raw(fmt.OUTPUT), g.tensors[fmt.OUTPUT].ggml_type, g.tensors[fmt.OUTPUT].shape)
    err = (w - head.lm_head.weight).norm() / head.lm_head.weight.norm()
    assert err < 0.15


def one_prompt_data(tg, text: str, new: int, copies: int):
    """Training data of `copies` times one conversation (the target's greedy reply of `new` tokens to `text`)
    and its draft vocabulary of 64."""
    prompt = data_mod.chat_prompt(tg.template, tg.tokenizer, text)
    rows = [(prompt, tg.generate([prompt], new, sample=False)[0], 1, False)] * copies
    conv = data_mod.Conversations.build(rows, dict(target="target.gguf", tokenizer=tg.tokenizer.fingerprint()))
    return conv, data_mod.draft_vocab(conv, tg.cfg.vocab_size, 64, always=tg.tokenizer.eot_ids)


def test_the_schedule_follows_steps_or_the_clock_whichever_ends_first():
    assert progress(50, 100, 1.0, None) == 0.5 and progress(50, 100, 1e9, None) == 0.5
    assert progress(50, 100, 30.0, 40.0) == 0.75                # the clock is further on than the steps
    assert progress(50, 100, 10.0, 40.0) == 0.5 and progress(10, 100, 99.0, 40.0) == 1.0
    assert lr_factor(0, 10, 0.0) == pytest.approx(0.1) and lr_factor(9, 10, 0.0) == pytest.approx(1.0)
    assert lr_factor(50, 10, 0.5) == pytest.approx(0.55) and lr_factor(50, 10, 1.0) == pytest.approx(0.1)


def test_a_time_limit_ends_training_decayed_and_checkpoints_leave_a_head(target, tmp_path, monkeypatch):
    """The clock, not the step count, ends this run: the steps after it are not taken, the last steps ran at
    the decayed rate, and each held-out score left the head as it then was."""
    from jllm.train import head as head_mod

    tg, _, d = target
    conv, d2t = one_prompt_data(tg, "Count to ten", 30, 5)
    torch.manual_seed(0)
    head = new_head(tg, d2t, ffn=64)
    clock = iter(range(10**6))                        # one "second" passes at every reading of the clock
    monkeypatch.setattr(head_mod.time, "perf_counter", lambda: float(next(clock)))
    lrs, saved = [], []
    real_step = torch.optim.AdamW.step

    def step(opt, *a, **k):
        lrs.append(opt.param_groups[0]["lr"])
        return real_step(opt, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    tc = TrainConfig(steps=1000, lr=1e-3, warmup=2, batch_tokens=512, max_len=256, ttt=2, log_every=2,
                     holdout=0.2, time_limit=60.0)
    logs = []
    hist = train(tg, head, conv, tc, log=logs.append, checkpoint=lambda h: saved.append(h.training))
    assert 5 < len(hist.loss) < 60 and len(lrs) == len(hist.loss)
    assert any("time limit of 60 s ends training" in line for line in logs)
    assert hist.held_acc[-1][0] == len(hist.loss)     # the head as it ended was scored on the held-out rows
    assert lrs[-1] < 0.2 * 1e-3 and max(lrs) > 0.5 * 1e-3   # it decayed to near the floor of 0.1 by the end
    assert saved and not any(saved)                 # checkpoints saw the head in eval mode

    out = tmp_path / "h.gguf"
    head_mod._checkpoint(str(out), head, str(d / "target.gguf"), gguf.GGMLQuantizationType.Q4_0)
    assert out.exists() and not (tmp_path / "h.gguf.part").exists()
    assert fmt.read_head_config(read_gguf(out)).ffn == 64


def test_jllm_runs_the_written_head_as_it_was_trained(target, tmp_path):
    """The written file, run by jllm's eagle3 head over jllm's target (its captured states), drafts what the
    training code computed: same layer inputs, same rows, same RoPE, same d2t."""
    from jllm.eagle3.head import Eagle3Head as RuntimeHead
    from jllm.model.loader import load_model

    tg, _, d = target
    ids = [5, 17, 250, 40, 41, 3, 99, 120, 7, 66, 12, 200]
    jm = load_model(d / "target.gguf", precision="exact", cache_weights=False)
    torch.manual_seed(2)
    head = new_head(tg, np.arange(0, 300, 3, dtype=np.int64), ffn=96)
    _, hidden = jm.forward(torch.tensor(ids), jm.new_cache(32), capture=head.c.target_layers)
    feats, _ = tg.features(torch.tensor([ids]), torch.tensor([len(ids)]), head.c.target_layers)
    assert torch.allclose(hidden, feats[0], atol=1e-4)          # jllm's captured states = training features

    path = tmp_path / "head_f32.gguf"
    write_head(path, head, str(d / "target.gguf"), gguf.GGMLQuantizationType.F32)
    rt = RuntimeHead.load(path, jm, precision="exact", use_cache=False)
    t, steps = 5, 4
    with torch.no_grad():
        hs = list(head.unroll(feats, torch.tensor([ids]), steps))
        s = rt.prefill(hidden[:t + 1], ids[1:t + 2])             # rows 0..t: (token s + 1, g_s)
        for j in range(steps):
            if j:
                s = rt.step(ids[t + 1 + j], s.state)             # the drafted row, fed its own state
            assert torch.allclose(s.state, hs[j][0, t], atol=1e-3), j
            assert torch.allclose(s.logits, head.logits(hs[j][0, t]), atol=1e-3), j
        assert rt.target_id(int(s.logits.argmax())) == int(head.d2t[head.logits(hs[-1][0, t]).argmax()])


def test_cli_passes_its_arguments_to_the_trainer(capsys, tmp_path):
    from jllm import cli

    assert cli.main(["train-head", "-m", "no-such-model", "-o", str(tmp_path / "h.gguf")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("jllm train-head: unknown model 'no-such-model'") and "\n" not in err
    with pytest.raises(SystemExit):
        cli.main(["train-head", "--help"])
    assert "--gen-time" in capsys.readouterr().out
    assert cli.main(["train-head", "-m", "x", "-o", "h.gguf", "--checkpoint", "--holdout", "0"]) == 1
    assert "--checkpoint writes the head at each held-out score" in capsys.readouterr().err


def test_bad_arguments_fail_before_any_work(capsys, tmp_path):
    """A typo in --qtype, an -o or --data that cannot be written, --data that is not ours, a missing --init:
    one line each, before the target loads (here no target exists: its error would come later)."""
    from jllm import cli

    out, junk = str(tmp_path / "h.gguf"), tmp_path / "x.gguf"
    junk.write_bytes(b"GGUF" + bytes(100))
    np.save(tmp_path / "arr.npy", np.zeros(3))
    cases = [
        (["-o", out, "--qtype", "Q4_K"], "--qtype Q4_K: not one of"),
        (["-o", str(tmp_path / "no-dir" / "h.gguf")], "cannot write the head"),
        (["-o", str(tmp_path)], "cannot write the head"),
        (["-o", out, "--data", str(tmp_path / "no-dir" / "d.npz")], "cannot write the training data"),
        (["-o", out, "--init", str(tmp_path / "none.gguf")], "--init"),
        (["-o", out, "--steps", "0"], "--steps must be at least 1 (got 0)"),
        (["-o", out, "--ttt", "0"], "--ttt must be at least 1"),
        (["-o", out, "--magpie", "-1"], "--magpie must be at least 0"),
        (["-o", out, "--batch-tokens", "100", "--max-len", "256"], "--batch-tokens (100) must hold one"),
        (["-o", out, "--lr", "0"], "--lr must be above 0"),
        (["-o", out, "--holdout", "0.9"], "--holdout must be between 0 and 0.5"),
        (["-o", out, "--sampled", "2"], "--sampled must be between 0 and 1"),
        (["-o", out, "--train-time", "0"], "--train-time must be above 0 seconds"),
    ]
    for extra, want in cases:
        assert cli.main(["train-head", "-m", "no-such-model", *extra]) == 1
        err = capsys.readouterr().err.strip()
        assert want in err and "\n" not in err, (extra, err)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["arr.npy", "x.gguf"]     # the probes left nothing
    keep = tmp_path / "h.gguf.probe"                  # nor touched a file beside -o
    keep.write_text("precious")
    assert cli.main(["train-head", "-m", "no-such-model", "-o", out]) == 1
    assert "unknown model" in capsys.readouterr().err and keep.read_text() == "precious"
    (tmp_path / "empty.npz").write_bytes(b"")
    np.savez(tmp_path / "whole.npz", meta=np.array("{}"), tokens=np.zeros(1000))
    (tmp_path / "cut.npz").write_bytes((tmp_path / "whole.npz").read_bytes()[:300])
    for bad in (junk, tmp_path / "arr.npy", tmp_path / "empty.npz", tmp_path / "cut.npz"):
        with pytest.raises(JllmError, match="not jllm training data"):
            data_mod.Conversations.load(bad)


def test_batched_decoder_matches_transformers_generate(target):
    """The data maker's decoder (static cache, left padding) gives `generate`'s greedy tokens, row by row."""
    tg, _, _ = target
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, tg.cfg.vocab_size, size=n).tolist() for n in (3, 11, 7, 1, 16)]
    want = tg.hf_generate(prompts, 24)
    got = tg.generate(prompts, 24, sample=False)
    assert got == want
    # a stop token ends its row after its first occurrence, the token kept
    stop = want[1][5]
    cut = [r[:r.index(stop) + 1] if stop in r else r for r in want]
    assert tg._decoder.generate(prompts, 24, {stop}) == cut and len(cut[1]) <= 6
    # nucleus sampling with a tiny top_p keeps only the top token: greedy again; a wide one samples
    assert tg.generate(prompts, 24, sample=True, top_p=1e-6, seed=1) == want
    a = tg.generate(prompts, 24, sample=True, temperature=1.5, seed=1)
    assert a == tg.generate(prompts, 24, sample=True, temperature=1.5, seed=1) and a != want


def test_batched_decoder_refills_rows_as_replies_end(target, monkeypatch):
    """More prompts than rows: a row whose reply has ended takes the next prompt, at its own slots, and every
    reply is still `generate`'s, in the prompts' order, whatever the order the rows ended in."""
    from jllm.train import batched

    tg, _, _ = target
    rng = np.random.default_rng(4)
    prompts = [rng.integers(5, tg.cfg.vocab_size, size=n).tolist() for n in (3, 11, 7, 1, 16, 9, 2)]
    want = tg.hf_generate(prompts, 20)
    monkeypatch.setattr(batched, "REFILL", 3)
    monkeypatch.setattr(batched, "SPAN", 8)          # steps attend over 8, 16, ... 40 slots as the rows grow
    dec = batched.BatchedDecoder(tg.model, 2, 40)
    assert dec.generate(prompts, 20, {-1}) == want
    # stop tokens end replies at different steps, so rows are refilled at different times
    stops = {want[0][4], want[2][2], want[5][9]}
    cut = [next((r[:i + 1] for i, t in enumerate(r) if t in stops), r) for r in want]
    assert sorted({len(r) for r in cut}) != [20]
    assert dec.generate(prompts, 20, stops) == cut
    assert dec.generate(prompts[:1], 20, stops) == cut[:1]          # fewer prompts than rows
    with pytest.raises(ValueError, match="slots"):
        dec.generate([[7] * 30], 20, stops)


def test_nucleus_within_top_k_equals_the_whole_sort():
    """The data maker's nucleus filter: found among the k most probable tokens where they hold top_p, by a
    sort of the whole row where they do not; either way the kept distribution is the whole sort's."""
    from jllm.train.batched import nucleus

    g = torch.Generator().manual_seed(0)
    V, k = 300, 16
    peaked = torch.softmax(torch.randn(4, V, generator=g) * 6, -1)        # nucleus inside the top 16
    flat = torch.softmax(torch.randn(2, V, generator=g) * 0.1, -1)        # nucleus of ~90 % of the row
    for probs, sorted_whole in ((peaked, False), (torch.cat([peaked, flat]), True)):
        for top_p in (0.5, 0.9, 0.95):
            p, idx = nucleus(probs, top_p, k)
            assert p.shape[-1] == (V if sorted_whole else k)
            got = torch.zeros_like(probs).scatter_(-1, idx, p)
            ps, order = probs.sort(-1, descending=True)
            want = torch.zeros_like(probs).scatter_(-1, order, ps * (ps.cumsum(-1) - ps < top_p))
            assert torch.equal(got, want)
            assert bool(((got > 0).sum(-1) >= 1).all())
    # sampling through it draws only tokens of the nucleus, all of them in time
    from jllm.train.batched import BatchedDecoder

    logits = torch.log(peaked[:1]).repeat(4000, 1)
    toks = BatchedDecoder._choose(logits, True, 1.0, 0.9, torch.Generator().manual_seed(1))
    p, idx = nucleus(peaked[:1], 0.9, k)
    assert set(toks.tolist()) == set(idx[0][p[0] > 0].tolist())


class Scripted:
    """A stand-in target for the data rounds: `reply(n, max_new)` gives the ids of the n-th reply (n counts
    every prompt seen so far, this one included); the prompts are kept decoded in `seen`."""

    def __init__(self, tg, reply):
        self.tokenizer, self.template, self.path = tg.tokenizer, tg.template, tg.path
        self.reply, self.seen = reply, []

    def generate(self, prompts, max_new, sample, **kw):
        start = len(self.seen)
        self.seen += [self.tokenizer.decode(p, skip_special=False) for p in prompts]
        return [self.reply(start + i + 1, max_new) for i in range(len(prompts))]


def test_writing_then_derived_then_back_translation_rounds(target):
    """The three rounds: writing prompts; prose tasks over the finished writing replies; translations of
    those back into English. A scripted target answers every prompt with a long, finished reply."""
    tg, _, _ = target
    tok = tg.tokenizer
    eot = min(tok.eot_ids)

    sc = Scripted(tg, lambda n, m: tok.encode(f" reply {n} " + "word " * 70)[:m - 1] + [eot])
    conv = data_mod.generate(sc, 0, 0, max_new=120, batch=8, n_writing=24, seed=2, log=lambda s: None)
    src = conv.source.tolist()
    assert src.count(2) == 24 and src.count(3) > 24                   # every writing reply got a task
    back = [p for p in sc.seen if "Translate this text into English:" in p]
    assert back and all("reply " in p for p in back)                  # ... translations came back
    asked = [p for p in sc.seen if "Translate this text into " in p or "Translate the following into " in p]
    assert len(back) == len(asked) - len(back)                        # every translation task, both forms
    derived = [p for p in sc.seen[24:] if p not in back]
    assert len(derived) == 24 and all("word word" in p for p in derived)
    typos = data_mod.add_typos("the quick brown foxes jumped over lazy sleeping dogs " * 20,
                               __import__("random").Random(0), rate=0.3)
    assert typos != "the quick brown foxes jumped over lazy sleeping dogs " * 20
    assert len(typos.split(" ")) == 20 * 9 + 1
    assert all(p.startswith("Write ") for p in data_mod.writing_prompts(5, __import__("random").Random(0)))


def test_questions_are_a_source_and_their_answers_get_prose_tasks(target):
    """Questions on how things work (source 5) are asked in the first round; each finished answer comes back
    in the second round with a prose task (source 3), as the writing replies do."""
    tg, _, _ = target
    tok = tg.tokenizer
    eot = min(tok.eot_ids)

    sc = Scripted(tg, lambda n, m: tok.encode(f" answer {n} " + "fact " * 70)[:m - 1] + [eot])
    conv = data_mod.generate(sc, 0, 0, max_new=120, batch=8, n_questions=16, seed=5, log=lambda s: None)
    src = conv.source.tolist()
    assert src.count(5) == 16 and src.count(2) == 0
    first = sc.seen[:16]
    assert all(any(t in p for t in data_mod.QUESTION_TOPICS) for p in first)
    assert len({p for p in first}) > 8                                 # forms x topics, not one question
    derived = [conv.ids(i) for i in range(len(conv)) if conv.source[i] == 3]
    assert len(derived) >= 16 and all("fact fact" in tok.decode(d, skip_special=False) for d in derived)


def test_requests_are_written_by_the_target_then_answered(target):
    """Requests (source 6): the target is asked to write a user's request about a topic; each finished one
    (unquoted) is then asked as a user turn, and its finished answer comes back with a prose task. An
    unfinished request, and a reply about the request instead of one, are dropped."""
    tg, _, _ = target
    tok = tg.tokenizer
    eot = min(tok.eot_ids)

    def reply(n, m):
        if n == 5:                                    # a reply about the request, not the request itself
            return tok.encode("Certainly! Here is the request: explain it all")[:m - 1] + [eot]
        if n <= 12:                                   # the requests: every fourth one runs out of tokens
            return tok.encode(f'"Please explain topic {n} in detail, for a student"')[:m - 1] + ([eot] if n % 4 else [])
        return tok.encode(f" answer {n} " + "fact " * 70)[:m - 1] + [eot]

    sc = Scripted(tg, reply)
    conv = data_mod.generate(sc, 0, 0, max_new=120, batch=4, n_requests=12, seed=6, log=lambda s: None)
    asks = sc.seen[:12]
    assert all("AI assistant" in p for p in asks)
    assert all(any(t in p for t in data_mod.QUESTION_TOPICS + data_mod.WRITING_TOPICS) for p in asks)
    src = conv.source.tolist()
    assert src.count(6) == 8                             # 12 written, 3 unfinished, 1 about the request
    asked = [tok.decode(conv.ids(i)[:conv.reply_start[i]], skip_special=False)
             for i in range(len(conv)) if conv.source[i] == 6]
    assert all("Please explain topic" in p and '"Please' not in p for p in asked)
    derived = [tok.decode(conv.ids(i), skip_special=False) for i in range(len(conv)) if conv.source[i] == 3]
    assert len(derived) >= 8 and all("fact fact" in d for d in derived)


def test_follow_up_round_continues_the_first_conversations(target):
    """With follow_share 1, every finished first-round reply gets a second user turn: the prompt is the
    template's rendering of (user, the target's reply, a follow-up), and its reply is trained on as source 4."""
    tg, _, _ = target
    tok = tg.tokenizer
    eot = min(tok.eot_ids)

    # every third reply runs out of tokens: not finished, so it gets no second turn
    sc = Scripted(tg, lambda n, m: tok.encode(f" answer {n} " + "text " * 10)[:m - 1] + ([] if n % 3 else [eot]))
    conv = data_mod.generate(sc, 0, 0, max_new=40, batch=4, n_writing=12, follow_share=1.0, seed=3,
                             log=lambda s: None)
    first = [(conv.ids(i)[:conv.reply_start[i]].tolist(), conv.ids(i)[conv.reply_start[i]:].tolist())
             for i in range(len(conv)) if conv.source[i] == 2]
    finished = [(p, r) for p, r in first if r[-1] == eot]
    follows = [conv.ids(i)[:conv.reply_start[i]].tolist() for i in range(len(conv)) if conv.source[i] == 4]
    assert 0 < len(finished) < len(first) and len(follows) == len(finished)
    for p, r in finished:
        user = tok.decode(p, skip_special=False).split("Write ", 1)[1].split(".", 1)[0]
        reply = tok.decode(r[:-1], skip_special=False).strip()
        match = [f for f in follows if f"Write {user}." in tok.decode(f, skip_special=False)
                 and reply in tok.decode(f, skip_special=False)]
        assert match, (user, reply)
        text = tok.decode(match[0], skip_special=False)
        wants = {tg.template.render([{"role": "user", "content": f"Write {user}."},
                                     {"role": "assistant", "content": reply},
                                     {"role": "user", "content": f.format(human=h)}], add_generation_prompt=True)
                 for f in data_mod.FOLLOW_UPS for h in data_mod.HUMAN_LANGUAGES}
        assert text in wants


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batched_decoder_matches_generate_for_llama_and_qwen3(tmp_path, arch):
    """The other training targets: llama (its Q/K rows un-permuted at load) and qwen3 (per-head q/k norms)."""
    write_tiny_model(tmp_path / "t.gguf", arch, num_hidden_layers=3, max_position_embeddings=512)
    tg = load_target(str(tmp_path / "t.gguf"))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(5, tg.cfg.vocab_size, size=n).tolist() for n in (4, 9, 2)]
    assert tg.generate(prompts, 16, sample=False) == tg.hf_generate(prompts, 16)


def test_a_run_can_start_from_a_written_head(target, tmp_path):
    """--init: every tensor comes back from the file, the output rows through both draft vocabularies (a
    target id in both takes the file's row, a new one keeps the target's row); a head of another shape is
    refused in one line naming what differs."""
    from jllm.train.head import init_from_head

    tg, _, d = target
    torch.manual_seed(3)
    old = new_head(tg, np.arange(0, 120, dtype=np.int64), ffn=96)
    with torch.no_grad():
        for p in old.parameters():
            p.add_(torch.randn_like(p) * 0.1)           # not the target's rows any more
    path = tmp_path / "old.gguf"
    write_head(path, old, str(d / "target.gguf"), gguf.GGMLQuantizationType.F32)

    d2t = np.arange(60, 200, dtype=np.int64)             # ids 60..119 in both, 120..199 new
    fresh = new_head(tg, d2t, ffn=96)
    assert init_from_head(fresh, path) == 60
    assert torch.equal(fresh.fc.weight, old.fc.weight) and torch.equal(fresh.down.weight, old.down.weight)
    assert torch.equal(fresh.hidden_norm, old.hidden_norm)
    assert torch.equal(fresh.lm_head.weight[:60], old.lm_head.weight[60:120])
    assert torch.equal(fresh.lm_head.weight[60:], tg.lm_head[torch.arange(120, 200)].to(fresh.lm_head.weight))
    with pytest.raises(JllmError, match=r"^--init old.gguf: its ffn is 96, this head's 64$"):
        init_from_head(new_head(tg, d2t, ffn=64), path)


def test_a_profiled_run_says_where_its_steps_time_went(target):
    """--profile N: N steps after the first under torch's profiler, its table of operators in the log."""
    tg, _, _ = target
    conv, d2t = one_prompt_data(tg, "Name three colours", 20, 3)
    torch.manual_seed(0)
    logs = []
    tc = TrainConfig(steps=4, lr=1e-3, warmup=1, batch_tokens=512, max_len=256, ttt=2, log_every=100, profile=2)
    train(tg, new_head(tg, d2t, ffn=64), conv, tc, log=logs.append)
    table = [line for line in logs if line.startswith("profile of 2 training steps")]
    assert len(table) == 1 and "aten::" in table[0] and "Self CPU" in table[0]
    logs.clear()
    train(tg, new_head(tg, d2t, ffn=64), conv, TrainConfig(steps=2, lr=1e-3, warmup=1, batch_tokens=512,
                                                            max_len=256, ttt=2, log_every=100, profile=5), log=logs.append)
    assert any(line.startswith("profile of 1 training steps") for line in logs)    # cut short by the end


def test_a_compiled_step_trains_as_the_eager_one(target):
    """--compile: the head's unrolled step through torch.compile gives the eager step's losses (to float
    rounding: the compiler fuses, and may sum in another order)."""
    tg, _, _ = target
    conv, d2t = one_prompt_data(tg, "Name three colours", 20, 3)
    losses = []
    for compiled in (False, True):
        torch.manual_seed(0)
        tc = TrainConfig(steps=2, lr=1e-3, warmup=1, batch_tokens=512, max_len=256, ttt=2, log_every=100,
                         compile=compiled)
        head = new_head(tg, d2t, ffn=64)
        losses.append(train(tg, head, conv, tc, log=lambda *a: None).loss)
        assert compiled == hasattr(head.block, "_torchdynamo_orig_callable")        # it did go through it
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
