"""The chat workload's prompt bank: several hundred questions and instructions written for servelab.

Prompts are templates filled with subjects (``"Explain {subject} in one short paragraph."`` x
40 subjects), plus factual questions, rewriting and translation tasks, and summaries of short
notes, so prompt lengths and answer lengths both vary (a one-word capital vs. a short story).
The bank is a fixed, ordered list: a seeded selection from it is reproducible.
"""
from __future__ import annotations

SUBJECT_TEMPLATES = (
    "What do you know about {subject}?",
    "Explain {subject} in one short paragraph.",
    "Give me three interesting facts about {subject}.",
    "Write a short poem about {subject}.",
    "How would you explain {subject} to a ten-year-old?",
    "What are the main advantages and disadvantages of {subject}?",
    "Summarize the history of {subject} in a few sentences.",
    "Write a one-sentence definition of {subject}.",
    "List five words you associate with {subject}.",
    "Tell me a very short story that involves {subject}.",
)
SUBJECTS = (
    "photosynthesis", "the water cycle", "black holes", "the Roman Empire", "machine learning",
    "the internet", "volcanoes", "coffee", "the piano", "honeybees", "electric cars",
    "the French Revolution", "gravity", "democracy", "the human heart", "rainbows", "chess",
    "the Moon", "recycling", "vaccines", "the printing press", "solar energy",
    "the Great Wall of China", "octopuses", "jazz music", "earthquakes", "baking bread",
    "the stock market", "DNA", "the Olympic Games", "climate change", "penguins",
    "the Amazon rainforest", "cloud computing", "the Renaissance", "tea", "glaciers", "bicycles",
    "the immune system", "prime numbers",
)
COUNTRIES = (
    "France", "Japan", "Brazil", "Canada", "Egypt", "Australia", "Germany", "India", "Mexico",
    "Kenya", "Italy", "Spain", "Norway", "Argentina", "South Korea", "Turkey", "Peru", "Greece",
    "Vietnam", "Portugal",
)
SENTENCES = (
    "the meeting got moved to tomorrow because half the team is out sick",
    "can you send me the report when you get a chance",
    "we need more chairs for the party on saturday",
    "the train was late again so i missed the start of the film",
    "thanks for helping me fix my bike last week",
    "the new cafe downstairs makes really good sandwiches",
    "please remember to water the plants while i am away",
    "our flight lands at six in the evening",
    "i think the printer on the third floor is broken",
    "the library will be closed on monday for repairs",
)
NOTES = (
    "The town council met on Tuesday to discuss the new bike lanes. Most residents who spoke were in "
    "favour, but shop owners on Main Street worried about losing parking spaces. The council will vote "
    "next month after a traffic study.",
    "Our team finished the quarter with sales up eight percent. The biggest growth came from online "
    "orders, while store sales stayed flat. Next quarter we plan to hire two more people for customer "
    "support and to launch the new catalogue.",
    "The hiking trail to the waterfall is about six kilometres long and climbs steadily through a pine "
    "forest. Bring water and good shoes, because the last part is rocky. The view from the top is worth it.",
    "Maria started learning the violin at forty. She practised twenty minutes every morning before work, "
    "and after two years she joined a small community orchestra that plays in the park each summer.",
    "The museum's new exhibition shows everyday objects from ancient Egypt: combs, sandals, toys and "
    "kitchen tools. The curators wanted visitors to see how ordinary people lived, not only the pharaohs.",
)
NUMBER_PAIRS = ((12, 30), (7, 8), (125, 75), (9, 11), (48, 52), (300, 45), (16, 16), (81, 19))


def prompt_bank() -> list[str]:
    """Every prompt of the bank, in a fixed order."""
    prompts = [t.format(subject=s) for t in SUBJECT_TEMPLATES for s in SUBJECTS]
    prompts += [f"What is the capital of {country}?" for country in COUNTRIES]
    prompts += [f"Name a famous dish from {country} and describe it briefly." for country in COUNTRIES]
    prompts += [f"Rewrite this sentence so it sounds formal: \"{s}\"" for s in SENTENCES]
    prompts += [f"Translate into French: \"{s}\"" for s in SENTENCES]
    prompts += [f"Fix the capitalization and punctuation of this sentence: {s}" for s in SENTENCES]
    prompts += [f"Summarize this note in one sentence:\n\n{note}" for note in NOTES]
    prompts += [f"Read this note and list its key points:\n\n{note}" for note in NOTES]
    prompts += [f"What is {a} plus {b}?" for a, b in NUMBER_PAIRS]
    prompts += [f"What is {a} times {b}? Answer with the number only." for a, b in NUMBER_PAIRS]
    return prompts
