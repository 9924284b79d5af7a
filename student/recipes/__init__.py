"""What a student trains: one recipe per file, each a `Recipe` (student/recipes/base.py).

    distill   hidden-state (and logit) distillation into a transformers causal LM (distill.py)
    eagle3    an EAGLE-3 draft model of the teacher (eagle3.py)

The loop (student/loop.py) and `training_function` (student/train.py) call only the recipe's
methods: `build` once, `loss` on every micro-batch, `save` once at the end. A new recipe is a new
file here with its `Recipe` subclass, named in `RECIPES` below and in `StudentConfig.recipe`.
"""

from __future__ import annotations

from student.recipes.base import Built, Recipe
from student.recipes.distill import Distill
from student.recipes.eagle3 import Eagle3

RECIPES: dict[str, type[Recipe]] = {r.name: r for r in (Distill, Eagle3)}

# Every term any recipe reports, in one fixed order (the step metrics' all-reduced vector).
TERMS: tuple[str, ...] = tuple(dict.fromkeys(t for r in RECIPES.values() for t in r.TERMS))


def recipe_for(cfg) -> Recipe:
    """The recipe `cfg.recipe` names (the config has already checked the name)."""
    return RECIPES[cfg.recipe]()


__all__ = ["RECIPES", "TERMS", "Built", "Recipe", "recipe_for"]
