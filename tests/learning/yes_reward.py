"""The rule reward of the learning tests: the fraction of a response's words that are "yes"."""

import re


def fraction_yes(response: str) -> float:
    words = re.findall(r"[a-z]+", response.lower())
    return sum(w == "yes" for w in words) / len(words) if words else 0.0


def reward(prompts: list, responses: list, rows: list) -> list:
    return [fraction_yes(r) for r in responses]
