"""Built-in generator of verifiable arithmetic word problems (the offline training set).

Why: the default run must train with no Hub and no files, on a 135M model. GSM8K is
far beyond SmolLM2-135M-Instruct, so its reward would be ~always 0 and GRPO would have
no signal. Level 1 here is a single small addition or subtraction in a short story
("Mia has 7 apples. Mia buys 5 more apples. How many apples does Mia have now?"), which
such a model sometimes answers right; higher levels add steps, multiplication, exact
division and larger numbers:

=====  ===========================================================  ==============
level  shape                                                         numbers
=====  ===========================================================  ==============
1      one step: a + b or a - b                                      1..20
2      two steps of +/-, a x b with small factors, "b more than a"   2..50
3      a x b +/- c, a - b x c                                        up to ~100
4      exact division after a product or sum, then +/-               up to ~500
5      three or four steps: products, differences, exact division    up to ~10 000
=====  ===========================================================  ==============

Every problem carries its worked ``steps`` (``"7 + 5 = 12"``), so a test can recompute
the answer independently; answers are non-negative integers.

Determinism and splits
----------------------
One ``random.Random(seed)`` stream draws problems, cycling through ``levels`` in order
(balanced levels). A problem's split is a function of its question text only
(sha256 -> 1 in 5 go to test), so train and test are disjoint for every seed and every
size, the test set does not change when ``n_train`` changes, and duplicates are skipped.
Same seed and sizes -> identical problems (Python's ``random`` is stable across runs
and platforms for ``randint``/``choice``).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

from qerl_pipeline.config import GeneratorConfig, parse

LEVELS: tuple[int, ...] = (1, 2, 3, 4, 5)
TEST_FRACTION_DENOM = 5  # 1 in 5 distinct questions belong to the test split

NAMES = (
    "Mia",
    "Tom",
    "Ava",
    "Leo",
    "Zoe",
    "Sam",
    "Ivy",
    "Max",
    "Lily",
    "Ben",
    "Nora",
    "Omar",
    "Ella",
    "Raj",
    "Lucy",
    "Ken",
    "Sara",
    "Dan",
    "Maya",
    "Eli",
)
ITEMS = (
    "apples",
    "pencils",
    "marbles",
    "stickers",
    "books",
    "cookies",
    "cards",
    "shells",
    "balloons",
    "oranges",
    "stamps",
    "coins",
    "flowers",
    "candies",
    "toy cars",
)


@dataclass(frozen=True)
class Problem:
    """One generated problem: question, integer answer, level and worked steps."""

    id: str
    question: str
    answer: int
    level: int
    steps: tuple[str, ...]


def _step(expr: str, value: int) -> str:
    return f"{expr} = {value}"


# ------------------------------------------------------------------------ templates
# Each template draws its numbers from rng and returns (question, answer, steps).
Template = Callable[[random.Random, str, str, str], tuple[str, int, tuple[str, ...]]]


def _l1_buy(rng, n, n2, it):
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return (
        f"{n} has {a} {it}. {n} buys {b} more {it}. How many {it} does {n} have now?",
        a + b,
        (_step(f"{a} + {b}", a + b),),
    )


def _l1_give(rng, n, n2, it):
    a = rng.randint(2, 20)
    b = rng.randint(1, a - 1)
    return (
        f"{n} had {a} {it}. {n} gave {b} {it} to {n2}. How many {it} does {n} have left?",
        a - b,
        (_step(f"{a} - {b}", a - b),),
    )


def _l1_box(rng, n, n2, it):
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return (
        f"There are {a} {it} in a box. {n} puts {b} more {it} in the box. How many {it} are in the box now?",
        a + b,
        (_step(f"{a} + {b}", a + b),),
    )


def _l1_eat(rng, n, n2, it):
    a = rng.randint(2, 20)
    b = rng.randint(1, a - 1)
    return (
        f"A basket has {a} {it}. {n} takes {b} {it} out of the basket. How many {it} are left in the basket?",
        a - b,
        (_step(f"{a} - {b}", a - b),),
    )


def _l2_buy_give(rng, n, n2, it):
    a, b = rng.randint(2, 50), rng.randint(2, 50)
    c = rng.randint(1, a + b - 1)
    return (
        f"{n} has {a} {it}. {n} buys {b} more {it} and then gives {c} {it} to {n2}. How many {it} does {n} have now?",
        a + b - c,
        (_step(f"{a} + {b}", a + b), _step(f"{a + b} - {c}", a + b - c)),
    )


def _l2_bags(rng, n, n2, it):
    a, b = rng.randint(2, 9), rng.randint(2, 10)
    return (
        f"{n} buys {a} bags of {it}. Each bag has {b} {it}. How many {it} does {n} buy?",
        a * b,
        (_step(f"{a} * {b}", a * b),),
    )


def _l2_more_than(rng, n, n2, it):
    a, b = rng.randint(2, 50), rng.randint(2, 30)
    return (
        f"{n} has {a} {it}. {n2} has {b} more {it} than {n}. How many {it} do {n} and {n2} have together?",
        a + a + b,
        (_step(f"{a} + {b}", a + b), _step(f"{a} + {a + b}", 2 * a + b)),
    )


def _l3_packs(rng, n, n2, it):
    a, b, c = rng.randint(2, 12), rng.randint(3, 12), rng.randint(1, 60)
    return (
        f"{n} already has {c} {it}. {n} buys {a} packs of {it} with {b} {it} in each pack. How many {it} does {n} "
        "have now?",
        a * b + c,
        (_step(f"{a} * {b}", a * b), _step(f"{a * b} + {c}", a * b + c)),
    )


def _l3_shop(rng, n, n2, it):
    b, c = rng.randint(2, 12), rng.randint(2, 9)
    a = b * c + rng.randint(1, 60)
    return (
        f"A shop has {a} {it}. It sells {b} {it} every day for {c} days. How many {it} does the shop have left?",
        a - b * c,
        (_step(f"{b} * {c}", b * c), _step(f"{a} - {b * c}", a - b * c)),
    )


def _l3_wage(rng, n, n2, it):
    a, b = rng.randint(5, 20), rng.randint(2, 9)
    c = rng.randint(1, a * b - 1)
    return (
        f"{n} earns {a} dollars per hour and works for {b} hours. Then {n} spends {c} dollars. How many dollars "
        f"does {n} have left?",
        a * b - c,
        (_step(f"{a} * {b}", a * b), _step(f"{a * b} - {c}", a * b - c)),
    )


def _l4_share(rng, n, n2, it):
    k, q, b = rng.randint(2, 12), rng.randint(5, 40), rng.randint(1, 30)
    total = k * q
    return (
        f"{n} has {total} {it} and shares them equally among {k} friends. Then each friend gets {b} more {it}. "
        f"How many {it} does each friend have?",
        q + b,
        (_step(f"{total} / {k}", q), _step(f"{q} + {b}", q + b)),
    )


def _l4_pack(rng, n, n2, it):
    a, b, k = rng.randint(3, 15), rng.randint(4, 20), rng.randint(3, 9)
    c = (k - (a * b) % k) % k + k * rng.randint(0, 5) or k  # at least one loose item
    total = a * b + c
    return (
        f"{n} buys {a} boxes with {b} {it} in each box and {c} loose {it}. {n} packs all the {it} equally into {k} "
        f"bags. How many {it} go in each bag?",
        total // k,
        (_step(f"{a} * {b}", a * b), _step(f"{a * b} + {c}", total), _step(f"{total} / {k}", total // k)),
    )


def _l4_trip(rng, n, n2, it):
    p, k = rng.randint(6, 40), rng.randint(3, 12)
    spent = rng.randint(1, p * k - 1)
    return (
        f"{k} friends each pay {p} dollars into a trip fund. They spend {spent} dollars on tickets. "
        f"How many dollars are left in the fund?",
        p * k - spent,
        (_step(f"{p} * {k}", p * k), _step(f"{p * k} - {spent}", p * k - spent)),
    )


def _l5_factory(rng, n, n2, it):
    a, d = rng.randint(120, 999), rng.randint(3, 14)
    c = rng.randint(6, 24)
    b = rng.randint(1, (a * d) // c - 1)
    made, shipped = a * d, b * c
    return (
        f"A factory makes {a} {it} per day for {d} days. It ships {b} crates with {c} {it} in each crate. "
        f"How many {it} are left at the factory?",
        made - shipped,
        (_step(f"{a} * {d}", made), _step(f"{b} * {c}", shipped), _step(f"{made} - {shipped}", made - shipped)),
    )


def _l5_savings(rng, n, n2, it):
    a, w, k = rng.randint(15, 95), rng.randint(8, 52), rng.randint(2, 6)
    saved = a * w
    b = saved % k + k * rng.randint(1, max(1, saved // (2 * k)))
    rest = saved - b
    return (
        f"{n} saves {a} dollars every week for {w} weeks. {n} spends {b} dollars on a bike and splits the rest "
        f"equally among {k} people. How many dollars does each person get?",
        rest // k,
        (_step(f"{a} * {w}", saved), _step(f"{saved} - {b}", rest), _step(f"{rest} / {k}", rest // k)),
    )


def _l5_orchard(rng, n, n2, it):
    r, t, f = rng.randint(12, 60), rng.randint(10, 40), rng.randint(8, 30)
    trees = r * t
    lost = rng.randint(1, trees - 1)
    left = trees - lost
    return (
        f"An orchard has {r} rows with {t} trees in each row. A storm destroys {lost} trees. Each remaining tree "
        f"gives {f} {it}. How many {it} does the orchard give?",
        left * f,
        (_step(f"{r} * {t}", trees), _step(f"{trees} - {lost}", left), _step(f"{left} * {f}", left * f)),
    )


TEMPLATES: dict[int, tuple[Template, ...]] = {
    1: (_l1_buy, _l1_give, _l1_box, _l1_eat),
    2: (_l2_buy_give, _l2_bags, _l2_more_than),
    3: (_l3_packs, _l3_shop, _l3_wage),
    4: (_l4_share, _l4_pack, _l4_trip),
    5: (_l5_factory, _l5_savings, _l5_orchard),
}


def generate_problem(rng: random.Random, level: int) -> Problem:
    """One problem of ``level`` drawn from ``rng``."""
    if level not in TEMPLATES:
        raise ValueError(f"generator level {level} unknown; allowed: {', '.join(map(str, LEVELS))}")
    template = rng.choice(TEMPLATES[level])
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    question, answer, steps = template(rng, name, other, item)
    digest = hashlib.sha256(question.encode()).hexdigest()
    return Problem(id=f"gen-L{level}-{digest[:12]}", question=question, answer=int(answer), level=level, steps=steps)


def split_of(question: str) -> str:
    """'test' or 'train', from the question text alone (disjoint for every seed)."""
    h = int(hashlib.sha256(question.encode()).hexdigest()[:8], 16)
    return "test" if h % TEST_FRACTION_DENOM == 0 else "train"


def generate_splits(cfg: GeneratorConfig | dict | None = None) -> dict[str, list[Problem]]:
    """``{"train": [...n_train], "test": [...n_test]}``; deterministic given ``cfg.seed``."""

    cfg = parse(GeneratorConfig, cfg, "data.generator")
    for level in cfg.levels:
        if level not in TEMPLATES:
            raise ValueError(f"data.generator.levels: level {level} unknown; allowed: {', '.join(map(str, LEVELS))}")
    want = {"train": cfg.n_train, "test": cfg.n_test}
    out: dict[str, list[Problem]] = {"train": [], "test": []}
    seen: set[str] = set()
    rng = random.Random(cfg.seed)
    max_draws = 50 * (cfg.n_train + cfg.n_test) + 1000
    for k in range(max_draws):
        if all(len(out[s]) >= want[s] for s in out):
            return out
        problem = generate_problem(rng, cfg.levels[k % len(cfg.levels)])
        if problem.question in seen:
            continue
        seen.add(problem.question)
        split = split_of(problem.question)
        if len(out[split]) < want[split]:
            out[split].append(problem)
    raise RuntimeError(
        f"generator could not find {cfg.n_train} train + {cfg.n_test} test distinct problems at levels "
        f"{cfg.levels} in {max_draws} draws (got {len(out['train'])} + {len(out['test'])}); lower n_train/n_test"
    )
