"""Prompt sets for chapter 07: input-grounded (the answer copies from the prompt) and open-ended.

Prompt lookup can only guess tokens that already occur in the sequence, so it is measured on
both kinds. The input-grounded tasks are the ones where it is known to help: repeating or
editing a given text or code, and extracting from a passage. Open-ended chat gives it little to
copy. Texts are written for this course.
"""
from __future__ import annotations

PASSAGES = [
    "The lighthouse stood on a rock at the mouth of the harbour. Every night the keeper climbed "
    "the spiral stairs, trimmed the wick and polished the great lens, so that ships coming home "
    "in the dark could see the beam from twenty miles away.",
    "Bread rises because yeast eats the sugars in the flour and releases carbon dioxide. The gas "
    "is trapped by a network of gluten proteins, which stretch like tiny balloons. Baking sets "
    "the network, and the bubbles become the holes in the crumb.",
    "The museum opens at nine in the morning and closes at six in the evening. Tickets cost "
    "twelve euros for adults and five euros for children. On the first Sunday of each month, "
    "entry is free for everyone.",
    "Honey bees communicate the location of flowers with a waggle dance. The angle of the dance "
    "shows the direction relative to the sun, and the length of the waggle shows the distance "
    "to the food.",
]
CODE = [
    "def total_price(items):\n    total = 0\n    for item in items:\n        total = total + "
    "item.price * item.quantity\n    return total\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n"
    "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
]
GROUNDED_TASKS = [
    lambda p: f"Repeat the following text exactly, word for word:\n\n{p}",
    lambda p: f"Rewrite the following text, changing only the first sentence to the past tense "
              f"and keeping everything else the same:\n\n{p}",
    lambda p: f"Here is a passage:\n\n{p}\n\nQuote the passage's second sentence exactly.",
    lambda p: f"Summarize this passage, reusing its own words where you can:\n\n{p}",
]
CODE_TASKS = [
    lambda c: f"Rename the function in this code to `compute`, and change nothing else:\n\n{c}",
    lambda c: f"Add a docstring to this function and return the full code:\n\n{c}",
]
OPEN = [
    "Write a short story about a robot who learns to paint.",
    "What are some good ways to stay focused while studying?",
    "Describe your ideal weekend in a few sentences.",
    "Give me three ideas for a birthday party for a seven-year-old.",
    "Why do people enjoy music?",
    "Write a short poem about autumn.",
    "What should I pack for a weekend camping trip?",
    "Explain why exercise is good for health.",
    "My friend is moving to another city. How can we stay close?",
    "Write a short letter thanking a teacher.",
    "What is a good way to start learning to cook?",
    "Tell me a fun fact about space and explain it.",
    "How do I make a small balcony feel more cozy?",
    "Write a haiku about the sea, then explain its imagery.",
    "What questions should I ask before adopting a pet?",
    "Describe a busy morning at a train station.",
]


def grounded_prompts(n: int = 8) -> list:
    """Input-grounded user messages: copy, edit, quote and extract tasks over given texts."""
    items = []
    for i in range(max(n, 1)):
        if i % 3 == 2:
            items.append(CODE_TASKS[(i // 3) % len(CODE_TASKS)](CODE[(i // 3) % len(CODE)]))
        else:
            items.append(GROUNDED_TASKS[i % len(GROUNDED_TASKS)](PASSAGES[i % len(PASSAGES)]))
    return items[:n]


def open_prompts(n: int = 8) -> list:
    return [OPEN[i % len(OPEN)] for i in range(n)]


def chat(tok, messages: list) -> list:
    """Apply the tokenizer's chat template to user messages (text prompts for the engine)."""
    return [tok.apply_chat_template([{"role": "user", "content": m}], tokenize=False,
                                    add_generation_prompt=True) for m in messages]
