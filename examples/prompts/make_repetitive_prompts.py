"""Build examples/prompts/repetitive.jsonl: a workload that repeats itself across requests, the
traffic suffix decoding's cross-request memory is for. Deterministic (rerun: same file).

Four kinds, interleaved in file order so that, run as a sequence (``spec-plugins bench
--memory sequence``), each request can draw on the ones before it:
- ``code-edit``: multi-turn edits of one Python file (the whole file is rewritten every turn);
  the files of different requests share their structure;
- ``tool-json``: one JSON schema (a booking tool call) filled with different values;
- ``shared-context``: several questions about one long document given in full each time;
- ``templated-report``: one report template filled for different projects.
"""

from __future__ import annotations

import json
from pathlib import Path

FILE = '''import json
from pathlib import Path


def load_{thing}s(path):
    with open(path) as f:
        return json.load(f)


def find_{thing}(items, name):
    for item in items:
        if item["name"] == name:
            return item
    return None


def total_{field}(items):
    total = 0
    for item in items:
        total += item["{field}"]
    return total


def save_{thing}s(items, path):
    Path(path).write_text(json.dumps(items, indent=2))
'''
EDITS = [
    ("book", "pages", ["Add a docstring to every function. Reply with the whole file in one code block.",
                       "Now add type hints to every function as well. Reply with the whole file again."]),
    ("order", "price", ["Add type hints to every function. Reply with the whole file in one code block.",
                        "Now rename find_order to get_order everywhere. Reply with the whole file again."]),
    ("user", "age", ["Add a docstring to every function. Reply with the whole file in one code block.",
                     "Now make total_age return 0 for an empty list explicitly. Reply with the whole file again."]),
    ("track", "seconds", ["Add type hints to every function. Reply with the whole file in one code block.",
                          "Now add a docstring to every function as well. Reply with the whole file again."]),
]

BOOKINGS = [
    ("Smith", "Friday", "19:00", 4, "window seat"),
    ("Garcia", "Saturday", "20:30", 2, "anniversary, quiet table"),
    ("Chen", "Sunday", "12:15", 6, "one high chair"),
    ("Okafor", "Thursday", "18:45", 3, "vegetarian menu"),
    ("Novak", "Friday", "21:00", 5, "terrace if possible"),
    ("Dubois", "Wednesday", "13:00", 2, "business lunch"),
]
TOOL = ("You are the front end of a restaurant booking tool. Turn the request below into a JSON object with "
        "exactly these keys: \"name\", \"day\", \"time\", \"guests\", \"notes\". Reply with the JSON object only.\n\n"
        "Request: {name} would like a table for {guests} on {day} at {time}. Note: {notes}.")

DOC = """Model TR-40 Espresso Machine: User Guide (excerpt)

1. Setup. Place the machine on a flat, dry surface at least 10 cm from the wall. Fill the water tank with
fresh cold water up to the MAX line. Press the power button; the lamp blinks while the boiler heats and
stays on when the machine is ready, after about 45 seconds.
2. Brewing. Insert the filter holder and turn it to the right until it locks. Press the single-cup button
for 30 ml or the double-cup button for 60 ml. The pump stops on its own.
3. Steam. Turn the steam knob to the left to start steam and to the right to stop it. Purge the wand for two
seconds before and after frothing milk.
4. Cleaning. Empty the drip tray every day. Rinse the filter holder after each use. Descale every 200 cups
or when the descale lamp lights up, using the TR descaling solution and the program in section 5.
5. Descaling program. Fill the tank with the solution, hold both cup buttons for 5 seconds, and wait until
the lamp stops blinking (about 20 minutes). Rinse by running two full tanks of clean water.
6. Faults. If no water comes out, check that the tank is seated and not empty. If the lamp blinks red, the
machine is too hot: switch it off for 15 minutes. Warranty: two years from the date of purchase."""
QUESTIONS = [
    "How long does the machine take to heat up, and how do I know it is ready?",
    "Explain step by step how to descale the machine.",
    "What should I do if no water comes out?",
    "How do I make a double espresso?",
    "How often should I clean the different parts?",
    "What does a blinking red lamp mean and what should I do?",
]

REPORT = ("Fill in this weekly status report for the project described below. Keep the headings exactly as "
          "they are.\n\n## Weekly status: <project>\n**Owner:** <owner>\n**Status:** <green/amber/red>\n"
          "### Done this week\n- ...\n### Planned next week\n- ...\n### Risks\n- ...\n\n"
          "Project: {project}. Owner: {owner}. This week: {done}. Next week: {next}. Risk: {risk}.")
PROJECTS = [
    ("Website redesign", "Ana", "finished the new home page and the contact form", "test on mobile phones",
     "the designer is on holiday for a week"),
    ("Warehouse scanner rollout", "Tom", "installed scanners in two of five halls", "train the night shift",
     "one supplier is late"),
    ("Customer survey", "Lea", "sent the survey to 2,000 customers", "analyse the first answers",
     "a low response rate"),
    ("Payroll migration", "Raj", "moved the March payroll to the new system", "run April in parallel",
     "tax codes differ between systems"),
    ("Office move", "Mia", "signed the lease and ordered furniture", "book the movers", "the lift may not be ready"),
    ("Mobile app release", "Sam", "fixed the login crash and passed review", "publish to the stores",
     "the store review may take longer"),
]


def build() -> list[dict]:
    groups = [
        [{"question_id": f"code-edit-{i + 1}", "category": "code-edit",
          "turns": [f"Here is a Python file:\n\n```python\n{FILE.format(thing=t, field=f)}```\n\n{a}", b]}
         for i, (t, f, (a, b)) in enumerate(EDITS)],
        [{"question_id": f"tool-json-{i + 1}", "category": "tool-json",
          "turns": [TOOL.format(name=n, day=d, time=tm, guests=g, notes=no)]}
         for i, (n, d, tm, g, no) in enumerate(BOOKINGS)],
        [{"question_id": f"shared-context-{i + 1}", "category": "shared-context",
          "turns": [f"Read this document and answer the question.\n\n{DOC}\n\nQuestion: {q}"]}
         for i, q in enumerate(QUESTIONS)],
        [{"question_id": f"report-{i + 1}", "category": "templated-report",
          "turns": [REPORT.format(project=p, owner=o, done=d, next=n, risk=r)]}
         for i, (p, o, d, n, r) in enumerate(PROJECTS)],
    ]
    out = []
    for i in range(max(len(g) for g in groups)):  # interleave: each kind recurs through the sequence
        out += [g[i] for g in groups if i < len(g)]
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("repetitive.jsonl")
    rows = build()
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {path.name}")
