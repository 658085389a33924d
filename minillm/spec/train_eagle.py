"""Train the EAGLE drafter (eagle.py) on the model's own conversations (eagle_data.py), on the CPU.

    python -m minillm.spec.eagle_data --out .cache/eagle      # the data (resumable pieces)
    python -m minillm.spec.train_eagle --data .cache/eagle    # train (resumable pieces), measure

`make train-eagle` runs both. Training is teacher-forced: at every position p of a conversation
the drafter sees the target's true feature f_p (plus a little uniform noise, as EAGLE does, so it
tolerates its own imperfect features when it drafts) and the token x_{p+1}, and learns

    loss = smooth_l1(g_p, f_{p+1})  +  ce_weight * cross_entropy(head(g_p), target)

the second term only where the model wrote the answer, and through the reduced FR-Spec head
(`--draft-vocab` most frequent answer tokens). The target of the second term (`--labels`):

    soft   (EAGLE's own loss) the target's distribution at p + 1, softmax(head(f_{p+1}))
           over the draft vocabulary: computed from the stored feature, so every position of a
           SAMPLED answer also teaches what greedy decoding would say there, and how sure the
           model is;
    token  the token the answer actually has, x_{p+2} (one-hot; a label outside the draft
           vocabulary counts only in the first term);
    argmax the target's greedy choice there, argmax head(f_{p+1}) over the whole vocabulary:
           the same as token on greedy answers, and on sampled ones what greedy decoding would
           have said (computed once per conversation, `greedy_labels`). The default: on 8
           shards for 4 epochs its held-out first-guess acceptance was 0.29, token's 0.28
           (within one standard error), soft's 0.25 (about 2.5 below)
           (benchmarks/results/eagle_ablation_cpu_20261125.json).

Only the drafter learns (fc and one decoder layer, started from the target's last layer); the
embedding and LM head stay the target's.

With `--ttt-steps d > 1` training also runs the drafter the way it drafts (EAGLE-3's "training-time
test", simplified): at depth e = 2 .. d, position p is fed the drafter's own output of depth e - 1
at p - 1 (its guess of f_p, detached) and the true token x_{p+1}, and attends to the true-feature
keys before p - e + 2 plus the guessed keys of depths 2 .. e on the diagonal: exactly the cache
that draft step e sees (`unrolled`). Each depth adds the same two loss terms, averaged.

Held-out measurement: on held-out conversations (topics AND styles no training conversation
used) answered greedily, walk every answer position, draft a chain of k tokens exactly as the
engine does (`eagle.draft_chain`) and count how far it matches what the model said: acceptance
by draft position and the mean accepted length, with the reduced head and with the full head.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..model import causal_attention


def load_shards(data: Path) -> tuple:
    train = []
    for p in sorted(data.glob("shard_*.pt")):
        train += torch.load(p)["seqs"]
    held = torch.load(data / "heldout.pt")["seqs"] if (data / "heldout.pt").exists() else []
    if not train:
        raise ValueError(f"no training shards in {data}; run python -m minillm.spec.eagle_data "
                         f"--out {data} first")
    return train, held


def frequent_tokens(seqs: list, size: int) -> torch.Tensor:
    """The `size` most frequent answer tokens (FR-Spec's draft vocabulary), sorted ids."""
    counts = torch.zeros(int(max(int(s["ids"].max()) for s in seqs)) + 1)
    for s in seqs:
        ans = s["ids"][s["answer_start"]:].long()
        counts.index_add_(0, ans, torch.ones(len(ans)))
    return counts.topk(min(size, int((counts > 0).sum()))).indices.sort().values


def coverage(seqs: list, vocab: torch.Tensor) -> float:
    inside = torch.zeros(int(vocab.max()) + 1 if len(vocab) else 1, dtype=torch.bool)
    inside[vocab] = True
    n = hit = 0
    for s in seqs:
        ans = s["ids"][s["answer_start"]:].long()
        hit += int(inside[ans.clamp(max=len(inside) - 1)].logical_and(ans < len(inside)).sum())
        n += len(ans)
    return hit / max(n, 1)


def batches(seqs: list, batch: int, g: torch.Generator) -> list:
    """Length-sorted groups of `batch` sequences, in random order."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]["ids"]))
    groups = [order[i:i + batch] for i in range(0, len(order), batch)]
    return [groups[i] for i in torch.randperm(len(groups), generator=g).tolist()]


def collate(seqs: list, idx: list, label_of: torch.Tensor) -> tuple:
    """Right-padded (feats in [B, T-1, C], next ids [B, T-1], feats out [B, T-1, C],
    reduced labels [B, T-1] with -100 where no loss, feature mask [B, T-1], answer mask
    [B, T-1]: 1 where g_p predicts an answer token, x_{p+2}, p + 2 >= answer start)."""
    T = max(len(seqs[i]["ids"]) for i in idx)
    C = seqs[idx[0]]["features"].shape[1]
    fin = torch.zeros(len(idx), T - 1, C)
    fout = torch.zeros(len(idx), T - 1, C)
    nxt = torch.zeros(len(idx), T - 1, dtype=torch.long)
    lab = torch.full((len(idx), T - 1), -100, dtype=torch.long)
    mask = torch.zeros(len(idx), T - 1)
    answer = torch.zeros(len(idx), T - 1)
    for b, i in enumerate(idx):
        s = seqs[i]
        ids, f, n = s["ids"].long(), s["features"].float(), len(s["ids"])
        fin[b, :n - 1], fout[b, :n - 1], nxt[b, :n - 1] = f[:-1], f[1:], ids[1:]
        mask[b, :n - 1] = 1
        a = max(s["answer_start"], 2)                        # label x_{p+2} for p + 2 >= a
        nxt2 = s["greedy_next"] if "greedy_next" in s else ids[2:]          # x_{p+2}, p < n - 2
        lab[b, a - 2:n - 2] = label_of[nxt2[a - 2:n - 2]]
        answer[b, a - 2:n - 2] = 1
    return fin, nxt, fout, lab, mask, answer


@torch.no_grad()
def greedy_labels(model, seqs: list, chunk: int = 512) -> None:
    """Add s["greedy_next"] [n - 2] to every conversation: the target's greedy token after
    position p + 1, argmax lm_head(f_{p+1}), for p = 0 .. n - 3 (the `argmax` labels)."""
    w = model.lm_head.weight
    for s in seqs:
        f = s["features"][1:-1].to(w.dtype)                                  # f_1 .. f_{n-2}
        s["greedy_next"] = torch.cat([(f[i:i + chunk] @ w.T).argmax(-1)
                                      for i in range(0, len(f), chunk)])


def draft_loss(g, fout, lab, mask, answer, w, labels: str = "soft") -> tuple:
    """(feature regression, cross-entropy) of drafter outputs g [B, T, C] against the target's
    next features fout [B, T, C]; w [V', C] the reduced head. labels 'soft': against
    softmax(fout @ w.T) on answer positions; 'token': against the reduced labels lab."""
    reg = (F.smooth_l1_loss(g, fout, reduction="none").mean(-1) * mask).sum() / mask.sum()
    logits = g @ w.T                                                      # [B, T, V']
    if labels in ("token", "argmax"):
        lab = lab.masked_fill(answer == 0, -100)
        return reg, F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=-100)
    if labels != "soft":
        raise ValueError(f"labels must be 'soft', 'token' or 'argmax', got {labels!r}")
    with torch.no_grad():
        p = F.softmax(fout @ w.T, dim=-1)                                 # the target's, [B, T, V']
    ce = -(p * F.log_softmax(logits, dim=-1)).sum(-1)                     # [B, T]
    return reg, (ce * answer).sum() / answer.sum().clamp(min=1)


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [B, T, ...] moved n positions later along T (zeros in front)."""
    return x if n == 0 else torch.cat([torch.zeros_like(x[:, :n]), x[:, :-n]], dim=1)


def unrolled(drafter, model, fin, nxt, steps: int) -> list:
    """The drafter's outputs at depths 1 .. steps, each [B, T, C]. Depth 1 is drafter(model,
    fin, nxt) (teacher-forced on the true features). At depth e position p is fed (the depth
    e - 1 output at p - 1, detached; x_{p+1}) and attends to the depth-1 keys of positions
    0 .. p - e + 1 and to the depth-j keys at position p - e + j for j = 2 .. e, as draft step e
    sees its cache. Rows p < e - 1 of depth e are garbage (no such draft): mask them."""
    layer, attn = drafter.layer, drafter.layer.self_attn
    B, T = nxt.shape
    H, KVH, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    cos, sin = model.rope(torch.arange(T).expand(B, T))
    emb = model.embed_tokens(nxt)

    def block(feats, attend):
        x = drafter.fc(torch.cat([emb, feats], dim=-1))
        q, k, v = attn.project(layer.input_layernorm(x), cos, sin)
        y = x + attn.o_proj(attend(q, k, v).reshape(B, T, H * D))
        return y + layer.mlp(layer.post_attention_layernorm(y)), k, v

    g, k1, v1 = block(fin, causal_attention)
    outs, ks, vs = [g], [], []
    group = H // KVH
    for e in range(2, steps + 1):
        def attend(q, k, v, e=e):
            ks.append(k)
            vs.append(v)
            kt, vt = k1.repeat_interleave(group, 2), v1.repeat_interleave(group, 2)
            s_true = torch.einsum("bqhd,bkhd->bhqk", q, kt) / math.sqrt(D)       # [B, H, T, T]
            pos = torch.arange(T)
            s_true = s_true.masked_fill(pos[None, :] > pos[:, None] - (e - 1), float("-inf"))
            # depth j's key at p - e + j: shift it e - j positions later
            kd = [_shift(kj, e - j).repeat_interleave(group, 2) for j, kj in enumerate(ks, 2)]
            vd = [_shift(vj, e - j).repeat_interleave(group, 2) for j, vj in enumerate(vs, 2)]
            s_diag = torch.stack([(q * kj).sum(-1) for kj in kd], -1) / math.sqrt(D)
            probs = torch.cat([s_true, s_diag.permute(0, 2, 1, 3)], -1).softmax(-1)
            out = torch.einsum("bhqk,bkhd->bqhd", probs[..., :T], vt)         # [B, T, H, D]
            pd = probs[..., T:].permute(0, 2, 1, 3)                            # [B, T, H, e-1]
            return out + sum(pd[..., i:i + 1] * vj for i, vj in enumerate(vd))
        g, _, _ = block(_shift(outs[-1].detach(), 1), attend)
        outs.append(g)
    return outs


def train(model, drafter, seqs: list, args, log=print) -> dict:
    """Resumable training: a checkpoint in args.data after every piece of args.budget_s."""
    ckpt = Path(args.data) / "train_ckpt.pt"
    label_of = torch.full((model.config.vocab_size,), -100, dtype=torch.long)
    label_of[drafter.draft_vocab] = torch.arange(len(drafter.draft_vocab))
    for p in model.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for n, p in drafter.named_parameters()], lr=args.lr,
                            weight_decay=0.0)
    per_epoch = -(-len(seqs) // args.batch)
    total = args.epochs * per_epoch
    state = {"step": 0, "seconds": 0.0}
    if ckpt.exists():
        saved = torch.load(ckpt)
        drafter.load_state_dict(saved["drafter"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        log(f"resuming at step {state['step']}/{total}")
    scale = torch.cat([s["features"][:64].float() for s in seqs[:64]]).std().item()
    t0 = time.perf_counter()
    w = drafter.head_weight(model, reduced=True).detach()                    # [V', C]
    while state["step"] < total:
        epoch = state["step"] // per_epoch
        order = batches(seqs, args.batch, torch.Generator().manual_seed(args.seed + epoch))
        for idx in order[state["step"] % per_epoch:]:
            fin, nxt, fout, lab, mask, answer = collate(seqs, idx, label_of)
            fin = fin + (torch.rand_like(fin) - 0.5) * 2 * args.noise * scale
            reg = ce = 0.0
            for e, g in enumerate(unrolled(drafter, model, fin, nxt, args.ttt_steps)):
                valid = _shift(torch.ones_like(mask), e)                     # rows p >= e
                r, c = draft_loss(g, fout, lab, mask * valid, answer * valid, w, args.labels)
                reg, ce = reg + r / args.ttt_steps, ce + c / args.ttt_steps
            loss = reg + args.ce_weight * ce
            lr = args.lr * 0.5 * (1 + math.cos(math.pi * state["step"] / total))
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            state["step"] += 1
            if state["step"] % 10 == 0:
                log(f"epoch {epoch} step {state['step']}/{total} reg {reg.item():.4f} "
                    f"ce {ce.item():.3f}")
            if state["step"] >= total or (state["step"] % per_epoch == 0):
                break
            if time.perf_counter() - t0 > args.budget_s:
                break
        if time.perf_counter() - t0 > args.budget_s and state["step"] < total:
            state["seconds"] += time.perf_counter() - t0
            torch.save({"drafter": drafter.state_dict(), "opt": opt.state_dict(),
                        "state": state}, ckpt)
            log(f"piece done at step {state['step']}/{total}; run again to continue")
            return {"done": False, **state}
    state["seconds"] += time.perf_counter() - t0
    return {"done": True, "steps": total, **state}


@torch.inference_mode()
def heldout_acceptance(model, drafter, seqs: list, k: int, reduced: bool) -> dict:
    """Greedy held-out conversations: at every answer position, the chain of k drafts against
    what the model said next. rate[j]: P(draft j right | drafts < j right); mean accepted
    length counts the drafts accepted per verification (0 .. k)."""
    from .eagle import draft_chain, new_state
    tried, right, accepted, positions = [0] * k, [0] * k, 0, 0

    def argmax(logits):
        return logits.argmax(-1).tolist(), None

    for s in seqs:
        if not s["greedy"]:
            continue
        ids, f = s["ids"].tolist(), s["features"].float()
        state = new_state(drafter, len(ids) + k + 1)
        for p in range(s["answer_start"] - 1, len(ids) - 1 - k):
            toks = ids[:p + 2]                                # the newest token is x_{p+1}
            feats = f[:p + 1] if not state.token_ids else f[p:p + 1]
            drafts, _ = draft_chain(drafter, model, state, toks, feats, k, argmax, reduced)
            n = 0
            for j, d in enumerate(drafts):
                tried[j] += 1
                if d != ids[p + 2 + j]:
                    break
                right[j] += 1
                n += 1
            accepted += n
            positions += 1
    return {"rate_by_position": [round(r / max(t, 1), 4) for r, t in zip(right, tried)],
            "mean_accepted": round(accepted / max(positions, 1), 4), "positions": positions}


def main(argv=None) -> None:
    from ..loader import load_model
    from .eagle import DEFAULT_EAGLE_WEIGHTS, EagleDrafter
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default=".cache/eagle")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ce-weight", type=float, default=0.5)
    ap.add_argument("--labels", choices=("soft", "token", "argmax"), default="argmax",
                    help="cross-entropy target: the target's distribution, the answer's token, "
                         "or the target's greedy token")
    ap.add_argument("--ttt-steps", type=int, default=1,
                    help="train on the drafter's own outputs up to this depth (1: teacher-forced)")
    ap.add_argument("--noise", type=float, default=0.1, help="uniform input noise x feature std")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k", type=int, default=5, help="chain length of the held-out measurement")
    ap.add_argument("--budget-s", type=float, default=540, help="seconds per piece")
    ap.add_argument("--out", default=str(DEFAULT_EAGLE_WEIGHTS))
    ap.add_argument("--report", default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, _ = load_model(args.model, dtype=torch.float32, device="cpu")
    seqs, held = load_shards(Path(args.data))
    vocab = frequent_tokens(seqs, args.draft_vocab)
    drafter = EagleDrafter.for_model(model, vocab)
    if args.labels == "argmax":
        greedy_labels(model, seqs)
    result = train(model, drafter, seqs, args, log=lambda s: print(s, flush=True))
    if not result["done"]:
        return
    drafter.eval()
    report = {"model": args.model, "train_conversations": len(seqs),
              "train_tokens": sum(len(s["ids"]) for s in seqs),
              "heldout_conversations": len(held), "draft_vocab": len(vocab),
              "heldout_vocab_coverage": round(coverage(held, vocab), 4),
              "epochs": args.epochs, "batch": args.batch, "lr": args.lr,
              "ce_weight": args.ce_weight, "labels": args.labels, "ttt_steps": args.ttt_steps,
              "noise": args.noise,
              "train_seconds": round(result["seconds"], 1), "torch_threads": args.threads,
              "heldout_reduced_head": heldout_acceptance(model, drafter, held, args.k, True),
              "heldout_full_head": heldout_acceptance(model, drafter, held, args.k, False),
              # the same walk on training conversations: the gap to held-out is overfitting
              "train_subset_reduced_head": heldout_acceptance(model, drafter, seqs[:96], args.k,
                                                              True)}
    print(json.dumps(report, indent=1))
    drafter.save(args.out, extra={"training": report})
    (Path(args.data) / "train_ckpt.pt").unlink(missing_ok=True)
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
