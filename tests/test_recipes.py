"""AGENTS.md's recipes ("Adding things: which files a change touches") against the tree they describe.

A recipe is followed literally by someone who does not know the code yet, so every file it cites
must exist and every name it places in a file must be defined there (a function, class, method,
constant or dataclass field, or imported into it). What the text says is read from the text:

- a path in backticks (`testbed/policies/policy.py`; a bare `selection.py` is looked up beside the
  path cited before it in the same recipe, then anywhere under testbed/ and tests/ if unique); a
  path with a placeholder (`testbed/quant/<scheme>.py`) needs its folder to exist;
- a name placed in a file: "`name` in `path`", "`path` (`name`, `name`)", "(`path`, `name`)", and a
  numbered step that begins "`path`:" (or "`path`," / "`path` with") places the names that follow
  it, up to the next path, in that file; "`name` (`path`)" only says the file uses the name, so
  there the file must mention it.

The counts themselves ("4 files") are measured by following a recipe with a toy (issue 47); what a
test can hold cheaply is the preset recipe's last unchecked step: docs/live.md's presets table
names every preset (the audit's table, step 2, is tests/test_policies.py's; docs/protocols.md,
step 3, is tests/test_describe.py's).
"""

from __future__ import annotations

import builtins
import keyword
import re
from pathlib import Path

from tests._helpers import REPO

SECTION = "## Adding things: which files a change touches"
TICK = re.compile(r"`([^`]+)`")
PATH = re.compile(r"^[\w./<>-]+(\.(py|md|json|sh)|/)$")
NAME = re.compile(r"^[A-Za-z_]\w*(\(\))?$")


def recipes(text: str) -> dict[str, str]:
    """The recipes of AGENTS.md's section: each paragraph that begins "A " or "An ", by its title."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    start = text.index(SECTION) + len(SECTION)
    end = text.find("\n## ", start)
    body = text[start:end if end >= 0 else None]
    out = {}
    for para in body.split("\n\n"):
        para = para.strip()
        if para.startswith(("A ", "An ")):
            out[re.split(r" \(|:", para, maxsplit=1)[0]] = para
    return out


def kind(token: str) -> str | None:
    if PATH.match(token) and ("/" in token or "." in token):
        return "path"
    bare = token.removesuffix("()")
    if NAME.match(token) and not hasattr(builtins, bare) and not keyword.iskeyword(bare):
        return "name"
    return None


def resolve(token: str, here: Path | None) -> Path | list[Path] | None:
    """The file or folder a cited path means: from the repository root, beside (or above) the
    previous path, under testbed/; else the one match under testbed/ or tests/ (a list: ambiguous)."""
    tries = [REPO / token]
    if here is not None:
        tries += [d / token for d in (here, *here.parents) if d != REPO and REPO in d.parents]
    tries.append(REPO / "testbed" / token)
    for t in tries:
        if t.exists():
            return t
    found = [p for top in ("testbed", "tests") for p in (REPO / top).glob("**/" + token)]
    return found[0] if len(found) == 1 else (found or None)


def defines(path: Path, name: str) -> bool:
    """Whether ``path`` defines ``name`` (def, class, assignment, dataclass field, attribute set in
    a method) or imports it."""
    n = re.escape(name)
    src = path.read_text()
    return any(re.search(p, src, re.M) for p in (
        rf"^\s*(async\s+)?(def|class)\s+{n}\b", rf"^\s*{n}\s*(:[^\n=]*)?=", rf"^\s*{n}\s*:",
        rf"^\s*self\.{n}\s*(:[^\n=]*)?=", rf"^\s*(from\s+\S+\s+)?import\b[^\n]*\b{n}\b", rf"^\s+{n},?\s*(#.*)?$"))


def names_before(para: str, toks: list, j: int) -> list[str]:
    """The names that end at token j-1 of ``para``, joined by ',', '/', 'or', 'and'."""
    got, k = [], j - 1
    while k >= 0 and kind(toks[k][2]) == "name":
        got.append(toks[k][2].removesuffix("()"))
        if k == 0 or not re.fullmatch(r"\s*(,|/)?\s*(or|and)?\s*", para[toks[k - 1][1]:toks[k][0]]):
            break
        k -= 1
    return got


def problems(text: str) -> tuple[list[str], int, int]:
    """What the recipes cite that the tree does not have, and how many paths and placed names were read."""
    out, n_paths, n_names = [], 0, 0
    for title, para in recipes(text).items():
        toks = [(m.start(), m.end(), m.group(1)) for m in TICK.finditer(para)]
        files: dict[int, Path | None] = {}  # token index -> the file it resolves to
        here = None
        for i, (_, _, t) in enumerate(toks):
            if kind(t) != "path":
                continue
            n_paths += 1
            if "<" in t:  # a placeholder: its folder must exist
                stem = t.split("<")[0].rpartition("/")[0]
                folder = resolve(stem, here) if stem else None
                if not isinstance(folder, Path) or not folder.is_dir():
                    out.append(f"{title}: `{t}`: no folder {stem!r}")
                files[i] = None
                continue
            hit = resolve(t, here)
            if isinstance(hit, list):
                out.append(f"{title}: `{t}` is ambiguous ({', '.join(str(p.relative_to(REPO)) for p in hit)})")
                hit = None
            elif hit is None:
                out.append(f"{title}: `{t}` does not exist")
            files[i] = hit
            if hit is not None:
                here = hit if hit.is_dir() else hit.parent

        placed: list[tuple[str, int, bool]] = []  # (name, path token index, must define)

        for i, (s, e, t) in enumerate(toks):
            if kind(t) != "path":
                continue
            gap = para[toks[i - 1][1]:s] if i else ""
            if re.fullmatch(r"\s+in\s+", gap):  # `name` in `path`
                placed += [(n, i, True) for n in names_before(para, toks, i)]
            elif re.fullmatch(r"\s*\(", gap):  # `name` (`path`): the file uses it
                placed += [(n, i, False) for n in names_before(para, toks, i)]
            rest = para[e:]
            m = re.match(r"\s*\(((?:[^()]|\([^()]*\))*)\)", rest) or re.match(r",\s*([^()]*)\)", rest)
            if m:  # `path` (`name`, ...) or (`path`, `name`)
                placed += [(n.removesuffix("()"), i, True) for n in TICK.findall(m.group(1)) if kind(n) == "name"]
            line_start = para.rfind("\n", 0, s) + 1
            if re.fullmatch(r"\s*\d+\.\s+", para[line_start:s]) and re.match(r":|,| with", rest):
                for _, _, t2 in toks[i + 1:]:  # a step that begins with the path: its names up to the next path
                    if kind(t2) == "path":
                        break
                    if kind(t2) == "name":
                        placed.append((t2.removesuffix("()"), i, True))
        for name, i, must_define in dict.fromkeys(placed):
            f = files.get(i)
            if f is None or f.is_dir():
                continue
            n_names += 1
            ok = defines(f, name) if must_define else re.search(rf"\b{re.escape(name)}\b", f.read_text())
            if not ok:
                out.append(f"{title}: `{name}` is not {'defined' if must_define else 'mentioned'} in "
                           f"{f.relative_to(REPO)} (cited as `{toks[i][2]}`)")
    return out, n_paths, n_names


def test_every_file_and_name_a_recipe_cites_exists():
    text = (REPO / "AGENTS.md").read_text()
    titles = recipes(text)
    assert len(titles) >= 5, f"the section's recipes were not found: {list(titles)}"
    found, n_paths, n_names = problems(text)
    assert not found, "\n".join(found)
    for title, para in titles.items():  # every recipe cites at least one file the check read
        assert any(kind(t) == "path" for t in TICK.findall(para)), title
    assert n_paths > 0 and n_names > 0


def test_the_check_names_a_missing_file_a_missing_name_and_an_ambiguous_file():
    text = (f"{SECTION}\n\nA toy (2 files): `testbed/policies/no_such_module.py`; `no_such_function` in "
            "`testbed/policies/policy.py`; `testbed/nowhere/<name>.py`; `stats.py`.\n"
            "1. `testbed/policies/presets.py`: `PRESETS` and `NOT_A_PRESET_TABLE`.\n\n## Next\n")
    found, _, _ = problems(text)
    assert any("no_such_module.py` does not exist" in f for f in found), found
    assert any("`no_such_function` is not defined in testbed/policies/policy.py" in f for f in found), found
    assert any("`NOT_A_PRESET_TABLE` is not defined in testbed/policies/presets.py" in f for f in found), found
    assert any("no folder 'testbed/nowhere'" in f for f in found), found
    assert any("`stats.py` is ambiguous" in f for f in found), found  # no path before it to stand beside
    assert not any("`PRESETS`" in f for f in found), found


def test_docs_live_presets_table_names_every_preset():
    """The preset recipe's step 3: docs/live.md's table of presets has a line for each preset (a
    name cell may list several, and `mix24_<rule>` stands for each rule listed under the table)."""
    from testbed.policies import PRESETS

    doc = (REPO / "docs" / "live.md").read_text()
    start = doc.index("Presets (`testbed.policies.PRESETS`")
    table = doc[start:doc.index("\n\n", doc.index("| name |", start))]
    cells = [c for line in table.splitlines() if line.startswith("| `") for c in TICK.findall(line.split("|")[1])]
    rules = TICK.findall(re.search(r"^`<rule>`: (.*)$", doc[start:], re.M).group(1))
    named = {c.replace("<rule>", r) for c in cells for r in (rules if "<rule>" in c else [""])}
    assert not set(PRESETS) - named, f"presets without a line in docs/live.md's table: {sorted(set(PRESETS) - named)}"
    assert not named - set(PRESETS), f"docs/live.md's table names what is not a preset: {sorted(named - set(PRESETS))}"
