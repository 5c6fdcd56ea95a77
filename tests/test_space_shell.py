"""A shell script read as bash reads its commands, without running any (sweeper/space/shell.py):
what `sweeper import` needs of tpu-recipes' run_recipe.sh and of a command typed by hand."""

from __future__ import annotations

import pytest

from sweeper.space.shell import ShellError, commands


def _words(text: str) -> list[list[str]]:
    return [c.words for c in commands(text)]


def test_variables_the_script_sets_are_expanded_where_it_uses_them():
    """As run_recipe.sh: XLA_FLAGS and MAXTEXT_ARGS set over several lines, then used inside
    xpk's double-quoted --command, where single quotes do not stop the expansion."""
    script = (
        'XLA_FLAGS=" \\\n  --xla_a=1 \\\n  --xla_b=2 "\n'
        'MAXTEXT_ARGS="\\\nmodel_name=m \\\nsteps=3"\n'
        "xpk workload create --device-type=tpu7x-4x4x4 \\\n"
        "  --command=\"export LIBTPU_INIT_ARGS='${XLA_FLAGS}' && python3 -m MaxText.train b.yml "
        '${MAXTEXT_ARGS}"\n'
    )
    (xpk,) = _words(script)
    inner = xpk[-1].removeprefix("--command=")
    assert inner == (
        "export LIBTPU_INIT_ARGS='   --xla_a=1   --xla_b=2 ' && "
        "python3 -m MaxText.train b.yml model_name=m steps=3"
    )
    export, train = commands(inner)
    assert export.words == ["export", "LIBTPU_INIT_ARGS=   --xla_a=1   --xla_b=2 "]
    assert train.words == ["python3", "-m", "MaxText.train", "b.yml", "model_name=m", "steps=3"]
    assert train.env == {"LIBTPU_INIT_ARGS": "   --xla_a=1   --xla_b=2 "}


def test_an_unquoted_expansion_is_split_into_words_and_a_quoted_one_is_not():
    script = 'ARGS="a=1  b=2"\nrun $ARGS "$ARGS" x${ARGS}y\nEMPTY=\nrun $EMPTY "$EMPTY"'
    assert _words(script) == [["run", "a=1", "b=2", "a=1  b=2", "xa=1", "b=2y"], ["run", ""]]


def test_what_the_script_cannot_know_stays_as_written():
    """A command's output, a variable set elsewhere, `$?`: no guess, the text as written."""
    script = (
        'export NAME="$(printf "%.26s" "${USER//_/-}-x")-$(date +%Y)"\n'
        "run name=\"${NAME}\" home=$HOME code=$? esc=\\${TPU_WORKER_ID} lit='$NAME'"
    )
    (_, run) = _words(script)
    assert run == [
        "run",
        'name=$(printf "%.26s" "${USER//_/-}-x")-$(date +%Y)',
        "home=$HOME",
        "code=$?",
        "esc=${TPU_WORKER_ID}",
        "lit=$NAME",
    ]


def test_a_commands_environment_is_what_the_script_exported_and_its_own_prefix():
    script = (
        "A=1\nexport B=2\nexport C\nC=3\nD=4 run one\nrun two # a comment\n"
        "if ! pip show xpk &> /dev/null; then run three 2>/dev/null; fi"
    )
    found = {c.words[1]: c.env for c in commands(script) if c.words[:1] == ["run"]}
    assert found == {
        "one": {"B": "2", "C": "3", "D": "4"},  # A is the shell's alone
        "two": {"B": "2", "C": "3"},  # D was one's alone
        "three": {"B": "2", "C": "3"},
    }
    assert ["pip", "show", "xpk"] in _words(script)  # `!` and the redirection are no words


def test_operators_end_commands_even_unspaced_and_lines_are_counted():
    listed = commands("a 1;b 2&&c 3 | d 4\n\ne \\\n 5 & (f 6)")
    assert [c.words for c in listed] == [["a", "1"], ["b", "2"], ["c", "3"], ["d", "4"],
                                         ["e", "5"], ["f", "6"]]  # fmt: skip
    assert [c.line for c in listed] == [1, 1, 1, 1, 3, 4]


@pytest.mark.parametrize(
    "text, line",
    [("a\nb 'open", 2), ('a "x\n\ny', 1), ("a $(b", 1), ("a ${B", 1), ("a `b", 1)],
)
def test_a_quote_never_closed_is_refused_with_its_line(text, line):
    with pytest.raises(ShellError) as caught:
        commands(text)
    assert caught.value.line == line and "never closed" in caught.value.message
