"""Build examples/prompts/train.jsonl: varied short chat prompts from templates (no downloads).

Deterministic: rerunning writes the same file. The prompts only need to cover the kinds of text the
target writes (explanations, lists, code, stories, advice), since the *responses* used for
training are the target's own greedy outputs (self-distillation).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "volcanoes", "the immune system", "electricity",
    "the French Revolution", "the Roman Empire", "climate change", "machine learning", "the internet",
    "vaccines", "earthquakes", "the moon", "democracy", "inflation", "recycling", "honey bees",
    "the human heart", "gravity", "rainbows", "plate tectonics", "the printing press", "DNA",
    "solar panels", "the stock market", "coral reefs", "sleep", "memory", "the Olympic Games",
    "chess", "coffee", "bread baking", "jazz music", "the Great Wall of China", "tides", "wind energy",
    "antibiotics", "the Renaissance", "penguins", "deserts", "rain forests", "batteries", "airplanes",
    "the periodic table", "volunteering", "public libraries", "bicycles", "tea", "glaciers",
]
AUDIENCES = ["a child", "a high school student", "a beginner", "a busy adult", "someone who has never heard of it"]
TASKS = [
    "Explain {t} in simple terms.", "What is {t}?", "Give me three facts about {t}.",
    "Explain {t} to {a}.", "Write a short paragraph about {t}.", "Why is {t} important?",
    "List five key ideas about {t}.", "Summarize the history of {t} in a few sentences.",
    "What are common misconceptions about {t}?", "Write a haiku about {t}.",
    "Write a short poem about {t}.", "Give me a quiz question about {t} with the answer.",
    "How would you teach {t} to {a}?", "What are the pros and cons of {t}?",
]
CODE = [
    "Write a Python function that {c}.", "How do I {c} in Python?", "Write a JavaScript function that {c}.",
    "Explain how to {c} step by step.",
]
CODE_TASKS = [
    "reverses a string", "checks if a number is prime", "computes the factorial of n", "sorts a list of numbers",
    "counts the vowels in a string", "finds the largest element in a list", "removes duplicates from a list",
    "reads a text file line by line", "computes the Fibonacci sequence", "checks if a word is a palindrome",
    "merges two dictionaries", "converts Celsius to Fahrenheit", "finds the average of a list",
    "counts word frequencies in a sentence", "flattens a nested list",
]
ADVICE = [
    "How can I improve my {x}?", "Give me tips for {x}.", "What is a good routine for {x}?",
    "I want to get better at {x}. Where should I start?",
]
ADVICE_TOPICS = [
    "sleep", "time management", "public speaking", "writing", "cooking", "running", "studying for exams",
    "saving money", "learning a language", "staying focused", "making friends in a new city", "drawing",
    "playing guitar", "job interviews", "reading more books",
]
STORY = [
    "Write a short story about {s}.", "Tell me a bedtime story about {s}.", "Write the opening line of a novel about {s}.",
    "Describe {s} in three sentences.",
]
STORY_TOPICS = [
    "a lost robot", "a dragon who loves books", "a cat on the moon", "a brave little mouse", "a haunted lighthouse",
    "a friendly ghost", "a time traveler", "a talking tree", "a pirate searching for treasure", "a snowman in summer",
]
MATH = [
    "What is {a} plus {b}?", "What is {a} times {b}?", "If I have {a} apples and give away {b}, how many are left?",
    "Is {a} an even number?", "What is {a} divided by 2?",
]
MISC = [
    "Translate 'good morning' into French.", "What is the capital of France?", "What is the capital of Japan?",
    "Name the planets of the solar system.", "Who wrote Romeo and Juliet?", "What is the boiling point of water?",
    "Give me a recipe for pancakes.", "Suggest a name for a pet goldfish.", "What should I pack for a beach trip?",
    "Write a thank-you note to a teacher.", "Write an email asking for a day off.", "Tell me a joke.",
    "What are the days of the week?", "List the primary colors.", "How many continents are there?",
    "What is the difference between weather and climate?", "Write a tweet about Monday mornings.",
    "Give me a motivational quote and explain it.", "How do airplanes fly?", "What is a noun?",
]


def build(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    pool: list[str] = []
    for t in TOPICS:
        for task in rng.sample(TASKS, 4):
            pool.append(task.format(t=t, a=rng.choice(AUDIENCES)))
    pool += [c.format(c=ct) for ct in CODE_TASKS for c in rng.sample(CODE, 2)]
    pool += [a.format(x=x) for x in ADVICE_TOPICS for a in rng.sample(ADVICE, 2)]
    pool += [s.format(s=x) for x in STORY_TOPICS for s in rng.sample(STORY, 2)]
    pool += [m.format(a=rng.randint(2, 99), b=rng.randint(2, 20)) for m in MATH for _ in range(3)]
    pool += MISC
    pool = sorted(set(pool))
    rng.shuffle(pool)
    return pool[:n]


if __name__ == "__main__":
    out = Path(__file__).with_name("train.jsonl")
    prompts = build()
    out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    print(f"wrote {len(prompts)} prompts to {out}")
