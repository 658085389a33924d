"""Training data for the EAGLE drafter (chapter 07): conversations the bundled model writes itself.

    python -m minillm.spec.eagle_data --out .cache/eagle --shards 72     # resumable, shard by shard

A drafter learns to predict what THIS model says next, so its data is the model's own output
(self-distillation), and what it is asked decides what the drafter can guess on new prompts. The
Medusa heads of this chapter were trained on eight instruction templates over 24 topics and
accepted 3-6% of drafts on open chat; this generator aims for breadth instead:

- topics: several hundred short subjects (`topics()`), from cooking to compilers;
- styles: explain, list, compare, rewrite, code, advice, story, define, how-to, pros and cons,
  model-written questions, chat follow-ups (`STYLES`);
- prompts partly written by the model: for the "ask" style the model first writes a question a
  person might ask about the topic, for "rewrite" it first writes the paragraph to rewrite, and a
  "followup" conversation continues the model's own first answer with a second user turn;
- answers by the model, half greedy and half sampled (temperature 0.8, top-p 0.95), each with a
  seed drawn from the generator's own seeded random stream;
- for every position of every conversation, the token and the target's feature (the final
  hidden state after the last norm, the vector the LM head reads), stored in fp16;
- a held-out split by topic AND style: `plan()` sets aside topics and styles that no training
  conversation uses; held-out conversations pair a held-out topic with a held-out style.

Each shard is one file (`shard_NNN.pt`); a run skips shards that exist, so a long generation can
be done in short pieces on a shared machine.
"""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

_TOPICS = """
the water cycle; volcanoes; earthquakes; tides; rainbows; clouds; hurricanes; glaciers; deserts;
coral reefs; rainforests; soil erosion; the ozone layer; solar panels; wind turbines; batteries;
nuclear power; electric motors; magnets; static electricity; lightning; sound waves; echoes;
lenses; mirrors; telescopes; microscopes; the speed of light; gravity; friction; levers; pulleys;
bridges; skyscrapers; tunnels; dams; canals; lighthouses; the compass; maps; time zones; calendars;
clocks; the moon's phases; eclipses; comets; Mars; Jupiter; Saturn's rings; the Milky Way; stars;
black holes; satellites; rockets; the space station; astronauts; DNA; cells; bacteria; viruses;
antibiotics; the heart; the lungs; the brain; bones; muscles; teeth; skin; the eyes; hearing;
taste; sleep; dreams; memory; habits; stress; exercise; stretching; running; swimming; cycling;
yoga; hiking; camping; fishing; gardening; composting; houseplants; tomatoes; potatoes; rice;
wheat; coffee; tea; chocolate; cheese; yogurt; bread baking; pizza; soup; salads; spices; sugar;
salt; vitamins; protein; breakfast; meal planning; food storage; kitchen knives; cast iron pans;
recycling; plastic waste; fast fashion; thrift shopping; budgeting; saving money; credit cards;
interest rates; inflation; taxes; insurance; renting an apartment; buying a car; job interviews;
resumes; remote work; meetings; email etiquette; public speaking; negotiation; leadership;
teamwork; time management; procrastination; note taking; learning a language; reading habits;
libraries; the printing press; paper; ink; pencils; typewriters; photography; film cameras;
painting; sculpture; pottery; knitting; woodworking; origami; calligraphy; jazz; classical
music; guitars; pianos; drums; singing; choirs; opera; theatre; ballet; movies; animation;
comics; poetry; novels; fairy tales; myths; chess; board games; card games; puzzles; video
games; football; basketball; tennis; baseball; cricket; golf; the Olympics; marathons;
skateboarding; surfing; skiing; dogs; cats; horses; birds; owls; penguins; whales; dolphins;
sharks; octopuses; ants; bees; butterflies; spiders; frogs; snakes; turtles; elephants; lions;
wolves; bears; dinosaurs; fossils; evolution; ancient Egypt; the pyramids; ancient Greece; the
Roman empire; the Vikings; medieval castles; knights; the Silk Road; the Renaissance;
explorers; the industrial revolution; steam engines; railways; the telegraph; the telephone;
radio; television; the internet; email; web browsers; search engines; passwords; encryption;
computer viruses; backups; spreadsheets; databases; programming; Python; JavaScript; recursion;
sorting algorithms; binary numbers; logic gates; CPUs; memory chips; hard drives; operating
systems; open source software; version control; unit tests; debugging; APIs; cloud computing;
robots; drones; self-driving cars; 3D printing; virtual reality; smartphones; smart watches;
headphones; wifi; GPS; barcodes; credit card chips; vending machines; elevators; escalators;
traffic lights; roundabouts; airports; airplanes; helicopters; hot air balloons; submarines;
sailing; ferries; bicycles; electric scooters; public transport; city parks; playgrounds;
museums; zoos; aquariums; festivals; birthdays; weddings; holidays; gift giving; friendship;
kindness; gratitude; apologies; family dinners; moving house; neighbours; volunteering;
charity; voting; laws; courts; newspapers; advertising; brands; logos; marketing; small
businesses; bakeries; farmers markets; supermarkets; online shopping; delivery trucks; shipping
containers; warehouses; factories; assembly lines; steel; glass; concrete; wood; cotton; wool;
silk; leather; rubber; oil; natural gas; coal; gold; diamonds; salt mines; mountains; rivers;
lakes; oceans; islands; caves; waterfalls; forests; grasslands; the Arctic; Antarctica;
weather forecasts; seasons; snow; fog; wind; thunderstorms; floods; droughts; wildfires
"""

# style -> templates; {t} topic, {u} a second topic, {x} text the model wrote first
STYLES = {
    "explain": ["Explain {t} in simple terms.", "How does {t} work?",
                "Can you explain {t} to a beginner?"],
    "list": ["List five interesting facts about {t}.", "Give me a few tips about {t}.",
             "What are the most important things to know about {t}?"],
    "compare": ["Compare {t} and {u}.", "What do {t} and {u} have in common?",
                "How is {t} different from {u}?"],
    "rewrite": ["Rewrite this paragraph in simpler words:\n\n{x}",
                "Make this text shorter and clearer:\n\n{x}"],
    "code": ["Write a short Python function related to {t}, with a comment.",
             "Write a small Python program that could help someone interested in {t}."],
    "advice": ["I want to get better at understanding {t}. Where should I start?",
               "What mistakes do people often make about {t}?"],
    "story": ["Write a short story that involves {t}.", "Write a short poem about {t}."],
    "define": ["What is {t}?", "Define {t} in one paragraph."],
    "howto": ["Give me step-by-step instructions for something to do with {t}.",
              "How can I learn more about {t} at home?"],
    "proscons": ["What are the pros and cons of {t}?", "Why do some people like {t}?"],
    "ask": ["{x}"],                                   # a question the model wrote
    "followup": ["Can you give me an example?", "Tell me more about that.",
                 "Can you summarize that in two sentences?", "Why is that?"],
}
MODEL_WRITES = {   # the model's first task for styles whose prompt it writes itself
    "ask": "Write one question a curious person might ask about {t}. Reply with the question only.",
    "rewrite": "Write a short paragraph about {t}.",
    "followup": "Tell me something interesting about {t}.",
}
HELD_STYLES = ("advice", "proscons")                 # no training conversation uses these


def topics() -> list:
    return [t.strip() for t in _TOPICS.replace("\n", " ").split(";") if t.strip()]


@dataclass
class Item:
    topic: str
    style: str
    template: str
    other: str          # the second topic of "compare"
    greedy: bool
    seed: int


def plan(num_items: int, split: str, seed: int = 0, held_topic_frac: float = 0.12) -> list:
    """`num_items` (topic, style) conversations of one split ("train" or "heldout"). The split
    is fixed by `seed`: held-out topics are a random `held_topic_frac` of `topics()`, held-out
    styles are HELD_STYLES; train items use neither, held-out items use both."""
    rng = random.Random(seed)
    tops = topics()
    rng.shuffle(tops)
    n_held = max(1, int(len(tops) * held_topic_frac))
    held_t, train_t = tops[:n_held], tops[n_held:]
    if split == "train":
        pool_t, pool_s = train_t, [s for s in STYLES if s not in HELD_STYLES]
    elif split == "heldout":
        pool_t, pool_s = held_t, list(HELD_STYLES)
    else:
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    rng = random.Random(f"{seed}-{split}")
    items = []
    for _ in range(num_items):
        t, s = rng.choice(pool_t), rng.choice(pool_s)
        items.append(Item(t, s, rng.choice(STYLES[s]), rng.choice(pool_t), rng.random() < 0.5,
                          rng.randrange(2 ** 31)))
    return items


def first_text(text: str) -> str:
    """The model's first paragraph, trimmed (a model-written question or paragraph)."""
    text = text.strip().split("\n\n")[0].strip()
    return text[:600]


@torch.inference_mode()
def conversations(llm, tok, items: list, max_tokens: int) -> list:
    """Run the items: first the model-written parts, then the answers. Returns one message list
    per item, ending with the model's answer."""
    from ..sampling import SamplingParams

    def params(it, n):
        if it.greedy:
            return SamplingParams(temperature=0.0, max_tokens=n)
        return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=n, seed=it.seed)

    def chat(msgs):
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    pre = [i for i, it in enumerate(items) if it.style in MODEL_WRITES]
    first = llm.generate([chat([{"role": "user", "content": MODEL_WRITES[items[i].style]
                                 .format(t=items[i].topic)}]) for i in pre],
                         [params(items[i], max_tokens if items[i].style == "followup" else 64)
                          for i in pre], use_tqdm=False)
    written = {i: o.text for i, o in zip(pre, first)}
    msgs = []
    for i, it in enumerate(items):
        if it.style == "followup":
            m = [{"role": "user", "content": MODEL_WRITES["followup"].format(t=it.topic)},
                 {"role": "assistant", "content": written[i].strip()},
                 {"role": "user", "content": it.template}]
        else:
            x = first_text(written.get(i, ""))
            m = [{"role": "user", "content": it.template.format(t=it.topic, u=it.other, x=x)}]
        msgs.append(m)
    outs = llm.generate([chat(m) for m in msgs], [params(it, max_tokens) for it in items],
                        use_tqdm=False)
    return [m + [{"role": "assistant", "content": o.text}] for m, o in zip(msgs, outs)], outs


@torch.inference_mode()
def target_features(model, ids: list) -> torch.Tensor:
    """The target's features for every position, no cache: ids [T] -> [T, C] (after the final
    norm: what the LM head reads)."""
    from .medusa import hidden_states
    return hidden_states(model, torch.tensor([ids], device=model.device))[0]


def make_shard(model, tok, items: list, max_tokens: int) -> dict:
    """One shard: token ids, where the last answer starts, features (fp16) per conversation."""
    from ..engine import LLM
    llm = LLM((model, tok), max_num_seqs=len(items), max_num_batched_tokens=2048,
              num_kv_blocks=len(items) * -(-(3 * max_tokens + 160) // 16))
    msgs, outs = conversations(llm, tok, items, max_tokens)
    seqs = []
    for it, o in zip(items, outs):
        ids = list(o.prompt_token_ids) + list(o.token_ids)
        seqs.append({"ids": torch.tensor(ids, dtype=torch.int32),
                     "answer_start": len(o.prompt_token_ids),
                     "features": target_features(model, ids).to(torch.float16),   # [T, C]
                     "topic": it.topic, "style": it.style, "greedy": it.greedy})
    return {"seqs": seqs}


def main(argv=None) -> None:
    from ..loader import load_model
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default=".cache/eagle")
    ap.add_argument("--shards", type=int, default=72, help="training shards to have")
    ap.add_argument("--shard-size", type=int, default=64, help="conversations per shard")
    ap.add_argument("--heldout", type=int, default=48, help="held-out conversations (one shard)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=540,
                    help="stop starting new shards after this many seconds")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, tok = load_model(args.model, dtype=torch.float32, device="cpu")
    train = plan(args.shards * args.shard_size, "train", args.seed)
    jobs = [("heldout.pt", plan(args.heldout, "heldout", args.seed))]
    jobs += [(f"shard_{i:03d}.pt", train[i * args.shard_size:(i + 1) * args.shard_size])
             for i in range(args.shards)]
    for name, items in jobs:
        if (out / name).exists():
            continue
        if time.perf_counter() - t0 > args.budget_s:
            print(f"budget reached; run again to continue from {name}", flush=True)
            return
        t1 = time.perf_counter()
        shard = make_shard(model, tok, items, args.max_tokens)
        shard["seconds"] = time.perf_counter() - t1
        torch.save(shard, out / f"{name}.tmp")
        (out / f"{name}.tmp").rename(out / name)
        n = sum(len(s["ids"]) for s in shard["seqs"])
        print(f"{name}: {len(items)} conversations, {n} tokens, {shard['seconds']:.0f} s",
              flush=True)
    print("all shards present", flush=True)


if __name__ == "__main__":
    main()
