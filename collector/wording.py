"""Counts in words, for everything that prints them: "1 traces" read as a slip."""


def counted(n: int, noun: str) -> str:
    """"1 trace", "2,048 spans"."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")
