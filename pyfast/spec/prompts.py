"""Built-in prompt sets for ``pyfast bench --spec``: copy-heavy (repeat, rewrite or continue a
given passage or code file) and plain chat. Each prompt is a user message; the bench applies the
model's chat template."""
from __future__ import annotations

PASSAGE = (
    "The river town woke slowly on market days. Before sunrise the bakers lit their ovens, and the "
    "smell of warm bread drifted down the narrow streets toward the harbor. Fishermen unloaded silver "
    "crates of herring while gulls circled overhead and argued over scraps. By seven o'clock the square "
    "was crowded with farmers selling apples, cheese, honey, and bundles of dried lavender. Children ran "
    "between the stalls, chasing a small brown dog that had stolen a sausage from the butcher. Old women "
    "compared prices and complained about the weather, which was always either too wet or too dry. At "
    "noon the church bell rang twelve times, and everyone paused for a moment to eat. In the afternoon "
    "the crowd thinned, the merchants packed their carts, and the town returned to its quiet rhythm "
    "until the next market day arrived."
)

CODE = '''def read_config(path):
    config = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config


def merge_configs(base, override):
    result = dict(base)
    for key, value in override.items():
        result[key] = value
    return result


def write_config(path, config):
    with open(path, "w") as f:
        for key in sorted(config):
            f.write(key + " = " + config[key] + "\\n")
'''

LETTER = (
    "Dear Ms. Patel,\n\nThank you for your letter of March 3rd regarding the delayed shipment of office "
    "chairs. We have checked with our warehouse and found that the order was packed on March 1st but "
    "was held at the depot because the delivery address was incomplete. The shipment left the depot "
    "this morning and should reach your office by Friday. We are sorry for the trouble this has caused, "
    "and we have refunded the delivery charge to your account.\n\nKind regards,\nTom Evans\nCustomer "
    "Service"
)

RECIPE = (
    "Lemon rice for two. Rinse one cup of rice until the water runs clear. Heat a spoon of oil in a "
    "pan, add a pinch of mustard seeds and wait until they pop. Add a handful of peanuts, a sliced "
    "green chili and a few curry leaves, and stir for one minute. Add the rice, two cups of water, "
    "half a spoon of salt and a pinch of turmeric. Cover and cook on low heat for fifteen minutes. "
    "Turn off the heat, squeeze in the juice of one lemon, mix gently and serve warm."
)

CLASS_CODE = '''class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, item):
        self.counts[item] = self.counts.get(item, 0) + 1

    def most_common(self, n):
        items = sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True)
        return items[:n]

    def total(self):
        return sum(self.counts.values())
'''

NOTICE = (
    "Notice to all residents: the water supply on Elm Street will be switched off on Tuesday from "
    "9 a.m. to 3 p.m. while the old pipes under the road are replaced. Please fill a few bottles "
    "with water the evening before. Parking on the east side of the street will not be allowed on "
    "that day. If you have questions, call the city office at 555-0142 between 8 a.m. and 5 p.m."
)

COPY_PROMPTS = [
    "Repeat the following text exactly:\n\n" + PASSAGE,
    "Here is a Python file:\n\n" + CODE + "\nRepeat the code above exactly, without any changes.",
    "Rewrite the following letter, changing only the name Tom Evans to Anna Berg:\n\n" + LETTER,
    "Copy this code and add a docstring to each function:\n\n" + CODE,
    "Repeat this recipe word for word:\n\n" + RECIPE,
    "Here is a Python class:\n\n" + CLASS_CODE + "\nWrite the same class again, unchanged.",
    "Rewrite this notice, changing Tuesday to Thursday and keeping everything else the same:\n\n" + NOTICE,
    "Copy the following class and add a type hint to every method:\n\n" + CLASS_CODE,
]

CHAT_PROMPTS = [
    "What are the main benefits of regular exercise?",
    "Explain how a rainbow forms.",
    "Write a short story about a robot who learns to paint.",
    "Give me three tips for learning a new language.",
]

PROMPT_SETS = {"copy": COPY_PROMPTS, "chat": CHAT_PROMPTS}


def load_prompts(spec: str) -> tuple[str, list[str]]:
    """A prompt set by name (copy, chat, all) or from a file (.json list of strings, or text with
    prompts separated by blank-line-dash lines ``\\n---\\n``). Returns (name, prompts)."""
    import json
    import os

    if spec in PROMPT_SETS:
        return spec, list(PROMPT_SETS[spec])
    if spec == "all":
        return spec, COPY_PROMPTS + CHAT_PROMPTS
    if not os.path.isfile(spec):
        raise ValueError(f"--prompts: {spec!r} is neither a prompt set ({', '.join(PROMPT_SETS)}, all) "
                         f"nor a file")
    with open(spec, encoding="utf-8") as f:
        text = f.read()
    if spec.endswith(".json"):
        data = json.loads(text)
        if not isinstance(data, list) or not all(isinstance(x, str) for x in data) or not data:
            raise ValueError(f"--prompts: {spec} must hold a JSON list of strings")
        return os.path.basename(spec), data
    prompts = [p.strip() for p in text.split("\n---\n") if p.strip()]
    if not prompts:
        raise ValueError(f"--prompts: {spec} holds no prompts")
    return os.path.basename(spec), prompts
