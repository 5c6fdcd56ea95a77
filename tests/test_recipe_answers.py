"""The sweep's answer against a published recipe (issue 62, benchmarks.recipe_answers): the
best point the screen finds in the recipe's imported space, beside the recipe itself."""

from __future__ import annotations

from benchmarks.recipe_answers import answer, imported
from benchmarks.recipe_rows import recipe_paths
from sweeper.search.screen import FITS, judge
from sweeper.space.points import first_point

LLAMA_8K = "training/ironwood/llama3.1-70b/8k-bf16-tpu7x-4x4x4/xpk/run_recipe.sh"


def test_one_file_a_recipe_and_its_xpk_command_first():
    paths = recipe_paths()
    recipes = ["/".join(p.split("/")[:4]) for p in paths]
    assert len(set(recipes)) == len(recipes) > 20
    assert (
        LLAMA_8K in paths
        and LLAMA_8K.replace("xpk/run_recipe.sh", "k8s/k8s_manifest.yaml") not in paths
    )


def test_the_best_beats_or_is_the_recipe_at_its_own_precision_and_changes_only_what_pays():
    """The best is judged again from its changes alone to the figure written; each change, set
    back to the recipe's value, costs tokens/s or the fit (else it would not be named); the
    recipe's bf16 is held (fp8 is priced 1.44x: it would be every bf16 recipe's best)."""
    row = answer(LLAMA_8K, sample=2000)
    assert row is not None and row["gain"] >= 0 and row["best_fits_est"] == "yes"
    import yaml

    changes = yaml.safe_load(row["best_changes"])
    assert changes and "precision.mode" not in changes
    space = imported(LLAMA_8K)
    start = first_point(space)
    best = judge(space, {**start, **changes})
    assert abs(best["est_tokens_per_sec_per_chip"] - row["best_est"]) < 1e-6
    for knob in changes:
        back = judge(space, {**start, **{k: v for k, v in changes.items() if k != knob}})
        assert back["verdict"] != FITS or back["est_tokens_per_sec_per_chip"] < row["best_est"]
