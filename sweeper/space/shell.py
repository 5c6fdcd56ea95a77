"""A shell script read as bash would read its simple commands, without running anything: the
words of each, with the variables the script set before it expanded (`$NAME`, `${NAME}`), and
the environment it runs in. Enough of bash for the published recipes (tpu-recipes'
run_recipe.sh: `XLA_FLAGS="..."`, `MAXTEXT_ARGS="..."`, then `xpk workload create --command="...
${MAXTEXT_ARGS}"`); what it cannot know (a command's output `$(...)`, a variable the script
never sets) stays in the words as written."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# What ends a simple command (a newline too), and what redirects one (its target is no word).
OPERATORS = ("&&", "||", ";;", ";", "|", "&", "(", ")")
REDIRECTIONS = ("&>>", "&>", ">>", ">&", "<<", ">", "<")
# Words before a command that are not it (`then python3 ...`, `! pip show xpk`).
KEYWORDS = frozenset(
    {"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "!", "{", "}", "time"}
)
# Commands whose NAME=value words set variables (`export A=1 B=2`).
DECLARES = frozenset({"export", "declare", "local", "readonly", "typeset"})
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=")


class ShellError(ValueError):
    """Text that does not read as a shell script (a quote never closed), and on what line."""

    def __init__(self, message: str, line: int):
        super().__init__(f"line {line}: {message}")
        self.message, self.line = message, line


@dataclass
class SimpleCommand:
    """One command of the script: its words, expanded (the `NAME=value` words before it taken
    out: `prefix`); the environment it runs with (what the script exported before it, and its
    prefix); the line it starts on."""

    words: list[str]
    env: dict[str, str]
    line: int
    prefix: dict[str, str] = field(default_factory=dict)


def commands(text: str) -> list[SimpleCommand]:
    """The script's simple commands in order, each as bash would run it."""
    return _Reader(text).read()


@dataclass
class _Word:
    words: list[str]  # what it expands to: one word, none, or several (an unquoted `$ARGS`)
    assignment: str | None  # NAME, where it is one NAME=value word at a command's start


class _Reader:
    def __init__(self, text: str):
        self.text = text
        self.i = 0
        self.line = 1
        self.variables: dict[str, str] = {}
        self.exported: dict[str, None] = {}  # in the order exported
        self.at_command = True  # where NAME=value sets a variable

    def read(self) -> list[SimpleCommand]:
        out: list[SimpleCommand] = []
        words: list[str] = []
        prefix: dict[str, str] = {}
        start = self.line
        redirect = False
        while True:
            self.at_command = not words or words[0] in DECLARES
            token = self._token()
            if token is None or isinstance(token, str):  # the end, or an operator
                if token in REDIRECTIONS:
                    redirect = True
                    continue
                if words or prefix:
                    finished = self._finish(words, prefix, start)
                    if words:  # `A=1` alone sets a variable: no command
                        out.append(finished)
                words, prefix = [], {}
                if token is None:
                    return out
                start = self.line
                continue
            if redirect:  # `&> /dev/null`: where the output goes, no word of the command
                redirect = False
                continue
            declaring = bool(words) and words[0] in DECLARES
            if token.assignment is not None:
                (text,) = token.words
                name, value = token.assignment, text.partition("=")[2]
                self.variables[name] = value
                if declaring:
                    if words[0] == "export":
                        self.exported[name] = None
                    words.append(text)
                else:
                    prefix[name] = value
                continue
            for text in token.words:
                if declaring and words[0] == "export" and _NAME.fullmatch(text):
                    self.exported[text] = None
                if not words and not prefix and text in KEYWORDS:
                    continue
                words.append(text)

    def _finish(self, words: list[str], prefix: dict[str, str], line: int) -> SimpleCommand:
        env = {name: self.variables[name] for name in self.exported if name in self.variables}
        if words:  # `A=1 cmd`: A is cmd's alone
            for name in prefix:
                if name not in self.exported:
                    self.variables.pop(name, None)
            env.update(prefix)
        return SimpleCommand(words=words, env=env, line=line, prefix=prefix)

    # -- tokens: an operator (str), a word, or None at the end ----------------------------

    def _token(self) -> str | _Word | None:
        text = self.text
        while self.i < len(text):
            c = text[self.i]
            if c in " \t\r":
                self.i += 1
            elif text.startswith("\\\n", self.i):
                self.i += 2
                self.line += 1
            elif c == "#":
                end = text.find("\n", self.i)
                self.i = len(text) if end < 0 else end
            else:
                break
        if self.i >= len(text):
            return None
        if text[self.i] == "\n":
            self.i += 1
            self.line += 1
            return ";"
        for op in (*REDIRECTIONS, *OPERATORS):
            if text.startswith(op, self.i):
                self.i += len(op)
                return op
        return self._word()

    def _word(self) -> _Word:
        text = self.text
        parts: list[str] = []
        done: list[str] = []  # words an unquoted expansion split off before the last
        quoted = False  # `""` is a word; an unquoted expansion of nothing is none
        match = _ASSIGNMENT.match(text, self.i) if self.at_command else None
        assignment = match.group(1) if match else None
        if match:
            parts.append(match.group(0))
            self.i = match.end()
        while self.i < len(text):
            c = text[self.i]
            if c in " \t\r\n" or text.startswith(OPERATORS, self.i):
                break
            if text.startswith(REDIRECTIONS, self.i):
                if "".join(parts).isdigit():  # `2>/dev/null`: a descriptor, no word
                    parts = []
                break
            if c == "\\":
                if text.startswith("\\\n", self.i):
                    self.line += 1
                else:
                    parts.append(text[self.i + 1 : self.i + 2])
                self.i += 2
            elif c == "'":
                end = text.find("'", self.i + 1)
                if end < 0:
                    raise ShellError("a single quote (') is never closed", self.line)
                parts.append(text[self.i + 1 : end])
                self.line += text.count("\n", self.i, end)
                self.i = end + 1
                quoted = True
            elif c == '"':
                parts.append(self._double_quoted())
                quoted = True
            elif c == "$":
                value, known = self._dollar()
                if not known or assignment is not None:  # an assignment's value is not split
                    parts.append(value)
                    continue
                pieces = re.split(r"[ \t\r\n]+", value)
                parts.append(pieces[0])
                for piece in pieces[1:]:
                    if "".join(parts) or quoted:
                        done.append("".join(parts))
                    parts, quoted = [piece], False
            elif c == "`":
                end = text.find("`", self.i + 1)
                if end < 0:
                    raise ShellError("a backquote (`) is never closed", self.line)
                parts.append(text[self.i : end + 1])
                self.line += text.count("\n", self.i, end)
                self.i = end + 1
            else:
                parts.append(c)
                self.i += 1
        last = "".join(parts)
        if last or quoted or assignment is not None:
            done.append(last)
        return _Word(done, assignment)

    def _double_quoted(self) -> str:
        text = self.text
        start_line = self.line
        self.i += 1
        parts: list[str] = []
        while self.i < len(text):
            c = text[self.i]
            if c == '"':
                self.i += 1
                return "".join(parts)
            if c == "\\" and self.i + 1 < len(text):
                nxt = text[self.i + 1]
                if nxt == "\n":
                    self.line += 1
                elif nxt in '$`"\\':
                    parts.append(nxt)
                else:
                    parts.append(c + nxt)
                self.i += 2
            elif c == "$":
                parts.append(self._dollar()[0])
            elif c == "`":
                end = text.find("`", self.i + 1)
                if end < 0:
                    raise ShellError("a backquote (`) is never closed", self.line)
                parts.append(text[self.i : end + 1])
                self.line += text.count("\n", self.i, end)
                self.i = end + 1
            else:
                if c == "\n":
                    self.line += 1
                parts.append(c)
                self.i += 1
        raise ShellError('a double quote (") is never closed', start_line)

    def _dollar(self) -> tuple[str, bool]:
        """The expansion at `$`: (its value, True) for a variable the script set; else the text
        as written (a command's output, `$?`, a variable set elsewhere) and False."""
        text = self.text
        start = self.i
        if text.startswith("$(", start):
            self.i = self._balanced(start + 1)
            return text[start : self.i], False
        if text.startswith("${", start):
            end = text.find("}", start)
            if end < 0:
                raise ShellError("a ${ is never closed with }", self.line)
            self.i = end + 1
            name = text[start + 2 : end]
            if _NAME.fullmatch(name) and name in self.variables:
                return self.variables[name], True
            return text[start : self.i], False
        match = _NAME.match(text, start + 1)
        if match:
            self.i = match.end()
            if match.group(0) in self.variables:
                return self.variables[match.group(0)], True
            return text[start : self.i], False
        special = start + 1 < len(text) and text[start + 1] in "?!$#@*-0123456789"
        self.i = start + (2 if special else 1)
        return text[start : self.i], False

    def _balanced(self, at: int) -> int:
        """The index after the `)` that closes the `(` at `at` (quotes inside respected)."""
        text = self.text
        depth, i, quote, line = 0, at, "", self.line
        while i < len(text):
            c = text[i]
            if c == "\n":
                line += 1
            if quote:
                if c == "\\" and quote == '"':
                    i += 1
                elif c == quote:
                    quote = ""
            elif c in "'\"":
                quote = c
            elif c == "\\":
                i += 1
            elif c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
                if depth == 0:
                    self.line = line
                    return i + 1
            i += 1
        raise ShellError("a $( is never closed with )", self.line)
