"""Train Medusa heads on the bundled model's own generations (self-distillation), on the CPU.

    python -m minillm.spec.train_medusa --threads 2    # what `make train-draft` runs (~8 min)
    python -m minillm.spec.train_medusa --num-prompts 48 --epochs 1     # a quicker, worse run

1. Generate: the target answers a set of generated instructions (greedy, through minillm.LLM).
2. Features: one no-cache forward per answer gives the final hidden state h_t at every position.
3. Train: head j learns to predict token t + 1 + j from h_t. Default loss "ce": cross-entropy
   through the target's frozen lm_head, which all heads reuse (this course's simplification: the
   Medusa paper gives each head its own output matrix, initialised from the LM head and trained
   with it). Loss "feature": regress the
   target's own hidden state h_{t+j}, whose lm_head gives that token; about 50x cheaper per
   position (no vocabulary-sized matmul) but, trained on the same 14,594 positions and measured
   on held-out prompts that shared the training topics, it stalled at a top-1 of 0.14 for head
   1 where "ce" reached 0.39.
   Only the heads' residual blocks learn: hidden x hidden weights per head.
4. Measure: on held-out prompts about topics the training never saw, how often head j's argmax
   equals the token the model produced (the greedy acceptance of draft position j when every
   earlier draft was right).
Writes fp16 safetensors (about 2.7 MB for 4 heads) with the metadata the loader checks.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch
import torch.nn.functional as F

TOPICS = ["the water cycle", "how vaccines work", "the French revolution", "black holes",
          "photosynthesis", "the history of the bicycle", "how a CPU executes instructions",
          "compound interest", "the rules of chess", "why the sky is blue", "volcanoes",
          "the immune system", "machine learning", "the Roman empire", "climate change",
          "how bread rises", "the solar system", "electric cars", "the printing press",
          "sleep and memory", "honey bees", "the internet", "earthquakes", "recycling plastic"]
TASKS = ["Explain {t} to a ten-year-old.", "Write a short paragraph about {t}.",
         "Give three facts about {t}.", "What are the main ideas behind {t}?",
         "Summarize {t} in a few sentences.", "Why is {t} important?",
         "Write a short story that involves {t}.",
         "List some common questions about {t} and answer them."]


def make_prompts(tok, num_train: int, num_heldout: int, seed: int = 0) -> tuple:
    """(training prompts, held-out prompts), chat-formatted. The held-out prompts are about topics
    no training prompt mentions, so held-out accuracy measures what carries over to new subjects,
    not how well the heads learned answers to these very topics."""
    rng = random.Random(seed)
    topics = TOPICS[:]
    rng.shuffle(topics)
    n_held_topics = -(-num_heldout // len(TASKS))
    held_topics, train_topics = topics[:n_held_topics], topics[n_held_topics:]
    if num_train > len(train_topics) * len(TASKS):
        raise ValueError(f"{num_train} training prompts asked for, but with {num_heldout} held out "
                         f"only {len(train_topics) * len(TASKS)} remain; ask for fewer")

    def items(tops, n):
        out = [task.format(t=topic) for topic in tops for task in TASKS]
        rng.shuffle(out)
        return [tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                        add_generation_prompt=True) for text in out[:n]]
    return items(train_topics, num_train), items(held_topics, num_heldout)


@torch.inference_mode()
def generate_data(model, tok, prompts, max_tokens: int) -> list:
    """[prompt ids + output ids] per prompt, and where the output starts."""
    from ..engine import LLM
    from ..sampling import SamplingParams
    longest = max(len(tok.encode(p)) for p in prompts) + max_tokens
    llm = LLM((model, tok), max_num_seqs=len(prompts), max_num_batched_tokens=4096,
              num_kv_blocks=len(prompts) * -(-longest // 16))      # everyone fits: no preemption
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                        use_tqdm=False)
    return [(o.prompt_token_ids + o.token_ids, len(o.prompt_token_ids)) for o in outs]


@torch.inference_mode()
def features(model, seqs, num_heads: int, prompt_tail: int = 8):
    """(hidden [N, C], labels [N, num_heads], future hidden [N, num_heads, C]) for every position
    t with t + num_heads + 1 < len, from the last `prompt_tail` prompt positions onward."""
    from .medusa import hidden_states
    hs, labels, future = [], [], []
    for ids, p in seqs:
        h = hidden_states(model, torch.tensor([ids], device=model.device))[0]   # [T, C]
        for t in range(max(0, p - prompt_tail), len(ids) - num_heads - 1):
            hs.append(h[t])
            labels.append(ids[t + 2:t + 2 + num_heads])       # head j (1-based) -> t + 1 + j
            future.append(h[t + 1:t + 1 + num_heads])         # h_{t+j} predicts token t + 1 + j
    return torch.stack(hs).float(), torch.tensor(labels), torch.stack(future).float()


def head_accuracy(model, heads, h, labels, batch: int = 512) -> list:
    """Top-1 accuracy of each head on (h, labels)."""
    correct = torch.zeros(heads.num_heads)
    with torch.inference_mode():
        for i in range(0, len(h), batch):
            logits = heads.logits(model, h[i:i + batch])      # [b, K, V]
            correct += (logits.argmax(-1) == labels[i:i + batch]).float().sum(0)
    return (correct / len(h)).tolist()


def train(model, heads, h, labels, epochs: int, batch: int, lr: float, seed: int = 0,
          log=print, future=None, loss_kind: str = "feature") -> None:
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    steps = epochs * -(-len(h) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    for p in model.parameters():
        p.requires_grad_(False)
    step = 0
    for epoch in range(epochs):
        order = torch.randperm(len(h), generator=g)
        for i in range(0, len(h), batch):
            idx = order[i:i + batch]
            if loss_kind == "feature":                        # [b, K, C] against h_{t+j}
                loss = F.smooth_l1_loss(heads(h[idx]), future[idx], beta=0.1) * 100
            else:
                logits = heads.logits(model, h[idx])          # [b, K, V]
                loss = F.cross_entropy(logits.flatten(0, 1), labels[idx].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step % 10 == 0 or step == steps:
                log(f"epoch {epoch} step {step}/{steps} loss {loss.item():.3f}")


def main(argv=None) -> None:
    from ..loader import load_model
    from .medusa import DEFAULT_WEIGHTS, MedusaHeads
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=176)
    ap.add_argument("--num-heldout", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--loss", choices=["feature", "ce"], default="ce")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--out", default=str(DEFAULT_WEIGHTS))
    ap.add_argument("--report", default=None, help="also write the measurements as JSON here")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: a shared machine's stalled OpenMP workers cost more)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, tok = load_model(args.model, dtype=torch.float32, device="cpu")
    try:
        train_prompts, held_prompts = make_prompts(tok, args.num_prompts, args.num_heldout)
    except ValueError as e:
        ap.error(str(e))
    seqs = generate_data(model, tok, train_prompts + held_prompts, args.max_tokens)
    t_gen = time.perf_counter() - t0
    train_seqs, held_seqs = seqs[:len(train_prompts)], seqs[len(train_prompts):]
    h, y, fut = features(model, train_seqs, args.num_heads)
    hv, yv, _ = features(model, held_seqs, args.num_heads)
    t_feat = time.perf_counter() - t0 - t_gen
    print(f"data: {len(train_seqs)} answers, {len(h)} training positions, {len(hv)} held out "
          f"(generation {t_gen:.0f} s, features {t_feat:.0f} s)", flush=True)
    heads = MedusaHeads.for_model(model, args.num_heads)
    before = head_accuracy(model, heads, hv, yv)
    train(model, heads, h, y, args.epochs, args.batch, args.lr,
          log=lambda s: print(s, flush=True), future=fut, loss_kind=args.loss)
    after = head_accuracy(model, heads, hv, yv)
    t_total = time.perf_counter() - t0
    report = {"model": args.model, "num_heads": args.num_heads, "num_prompts": args.num_prompts,
              "num_heldout": args.num_heldout, "max_tokens": args.max_tokens,
              "epochs": args.epochs, "loss": args.loss, "train_positions": len(h),
              "heldout_positions": len(hv),
              "heldout_top1_before": before, "heldout_top1_after": after,
              "seconds": round(t_total, 1), "torch_threads": torch.get_num_threads()}
    print(json.dumps(report, indent=1))
    heads.save(args.out, extra={"training": report})
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
