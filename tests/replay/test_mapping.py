"""--map rename files: rules, first full match, parameter names, and errors that point at file:line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from parity_harness.common.errors import InputError, MapFileError
from parity_harness.replay.naming.mapping import RenameMap, parse_map, read_map, unused_rules

MAP = r"""
# port -> reference
^layers\.(\d+)\.norm1$   => h.\1.ln_1
^layers\.(\d+)\.norm2    => h.\1.ln_2     # trailing comment; no '$' needed: the match is full anyway
^layers\.(\d+)\.dropout  => -

^layers\.(\d+)           => h.\1
^layers\.(\d+)\.(.*)     => h.\1.other.\2
^stem                    => -
(?P<name>head)(?P<rest>\..*)? => lm_\g<name>\g<rest>
"""


@pytest.fixture
def rename() -> RenameMap:
    """The map above, parsed."""
    return parse_map(MAP)


# ------------------------------------------------------------------ module paths


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("layers.3.norm1", "h.3.ln_1"),
        ("layers.12.norm2", "h.12.ln_2"),
        ("layers.3", "h.3"),
        ("layers.3.norm1.extra", "h.3.other.norm1.extra"),
        ("layers.0.mlp.fc", "h.0.other.mlp.fc"),
        ("layers.3.dropout", None),
        ("stem", None),
        ("stem.conv", "stem.conv"),
        ("head", "lm_head"),
        ("head.proj", "lm_head.proj"),
        ("decoder.out", "decoder.out"),
        ("", ""),
    ],
    ids=[
        "group-ref", "full-match-without-dollar", "shorter-rule-after-longer", "later-rule-when-earlier-is-prefix",
        "two-groups", "dash-means-none", "dash-root", "prefix-of-dash-rule-is-kept", "named-group",
        "named-groups", "unmatched-keeps-name", "root-module",
    ],
)  # fmt: skip
def test_module(rename: RenameMap, path: str, expected: str | None) -> None:
    """Each module path maps by the first rule whose regex matches the whole path."""
    assert rename.module(path) == expected


def test_first_full_match_wins() -> None:
    """Of two rules that both match the whole path, the earlier applies."""
    rename = parse_map("a\\.(\\d) => first.\\1\na\\..* => second")
    assert rename.module("a.1") == "first.1"
    assert rename.module("a.x") == "second"


def test_prefix_match_does_not_apply() -> None:
    """A rule matching only a prefix (re.match/search semantics) is skipped, and the next rule is tried."""
    rename = parse_map("enc => encoder\nenc\\.(.*) => encoder.blocks.\\1")
    assert rename.module("enc") == "encoder"
    assert rename.module("enc.0") == "encoder.blocks.0"
    assert rename.module("my_enc") == "my_enc"


def test_search_match_does_not_apply() -> None:
    """A rule matching in the middle of the path does not apply."""
    assert parse_map("norm => ln").module("layers.0.norm") == "layers.0.norm"


def test_empty_map_renames_nothing() -> None:
    """A map of only comments and blank lines keeps every name."""
    rename = parse_map("\n# nothing here\n   \n\t# indented comment\n")
    assert rename.rules == ()
    assert rename.module("a.b") == "a.b"
    assert RenameMap().parameter("a.b.weight") == "a.b.weight"


def test_comments_and_blank_lines_are_skipped(rename: RenameMap) -> None:
    """Only rule lines become rules, in file order."""
    assert [pattern.pattern for pattern, _ in rename.rules][:2] == [r"^layers\.(\d+)\.norm1$", r"^layers\.(\d+)\.norm2"]
    assert len(rename.rules) == 7


def test_whitespace_around_separator_is_ignored() -> None:
    """'REGEX=>REPLACEMENT' without spaces, or with tabs, parses the same."""
    assert parse_map("a=>b").module("a") == "b"
    assert parse_map("\ta\t=>\tb\t").module("a") == "b"


# ------------------------------------------------------------------ parameter names


@pytest.mark.parametrize(
    ("rules", "name", "expected"),
    [
        (r"^layers\.(\d+)\.norm1 => h.\1.ln_1", "layers.3.norm1.weight", "h.3.ln_1.weight"),
        (r"^layers\.(\d+)\.norm1 => h.\1.ln_1", "layers.3.norm2.weight", "layers.3.norm2.weight"),
        (r"^layers\.(\d+)\.norm1 => h.\1.ln_1", "layers.3.norm1", "h.3.ln_1"),
        (r"^attn\.bias_u => attn.pos_bias_u", "attn.bias_u", "attn.pos_bias_u"),
        ("^attn => mha\n^attn\\.bias_u => mha.pos_bias_u", "attn.bias_u", "mha.pos_bias_u"),
        ("^attn => mha\n^attn\\.bias_u => mha.pos_bias_u", "attn.weight", "mha.weight"),
        (r"^attn\.bias_u => -", "attn.bias_u", None),
        (r"^layers\.(\d+)\.drop => -", "layers.3.drop.mask", None),
        (r".* => everything", "weight", "weight"),
        (r"model(.*) => \1", "model.weight", "weight"),
        (r"^blocks\.0 => blocks.1", "blocks.0.attn.bias", "blocks.0.attn.bias"),
    ],
    ids=[
        "module-renamed", "module-unmatched", "rule-matching-the-whole-name", "param-renamed",
        "param-rule-after-module-rule", "other-param-of-the-module", "param-without-counterpart",
        "module-without-counterpart",
        "root-level-param-unchanged", "module-mapped-to-root", "only-the-owning-module-is-mapped",
    ],
)  # fmt: skip
def test_parameter(rules: str, name: str, expected: str | None) -> None:
    """A parameter's bundle name is what a rule matching its whole name (not its module's) gives, else its owning
    module's mapped path plus its own name."""
    assert parse_map(rules).parameter(name) == expected


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("a => b\nno separator here\n", 2, "expected 'REGEX => REPLACEMENT'"),
        ("# comment\n\n   => b\n", 3, "expected 'REGEX => REPLACEMENT'"),
        ("a =>   # nothing after the arrow\n", 1, "expected 'REGEX => REPLACEMENT'"),
        ("a => b\n# ok\n^layers\\.((\\d+) => h\n", 3, "invalid regular expression"),
        ("a[ => b", 1, "invalid regular expression"),
        ("^layers\\.(\\d+) => h.\\2", 1, "is invalid for a regex with 1 group(s)"),
        ("^layers\\.\\d+ => h.\\1", 1, "is invalid for a regex with 0 group(s)"),
        ("(?P<n>\\d+) => h.\\g<m>", 1, "is invalid for a regex with 1 group(s)"),
    ],
    ids=[
        "missing-separator", "missing-regex", "missing-replacement", "unbalanced-paren", "unclosed-bracket",
        "group-beyond-count", "group-without-groups", "unknown-named-group",
    ],
)  # fmt: skip
def test_parse_map_errors(text: str, line: int, message: str) -> None:
    """A bad line raises MapFileError whose message starts with source:line and says what is wrong."""
    with pytest.raises(MapFileError, match=re.escape(message)) as info:
        parse_map(text, "port.map")
    assert str(info.value).startswith(f"port.map:{line}: ")


def test_parse_map_default_source() -> None:
    """Without a source name, errors point at '<map>'."""
    with pytest.raises(MapFileError, match=r"^<map>:1: "):
        parse_map("oops")


def test_map_file_error_is_input_error() -> None:
    """MapFileError is a user-input error (InputError, ValueError) for the CLI's exit code 2."""
    with pytest.raises(InputError):
        parse_map("oops")
    with pytest.raises(ValueError, match="expected 'REGEX => REPLACEMENT'"):
        parse_map("oops")


@pytest.mark.parametrize("reference", [r"\0", r"\1", r"\g<0>", r"\g<1>", r"\g<x>"], ids=str)
def test_valid_group_references_accepted(reference: str) -> None:
    """References to groups the regex has (by number, by name, or the whole match) are accepted."""
    rename = parse_map(rf"(?P<x>a)b => {reference}")
    assert rename.module("ab") in {"\x00", "a", "ab"}


@pytest.mark.parametrize("replacement", [r"h.\q", "h.\\"], ids=["bad-escape", "trailing-backslash"])
def test_invalid_replacement_template_is_a_map_file_error(replacement: str) -> None:
    """A replacement that re cannot expand is reported at parse time as MapFileError with file:line."""
    with pytest.raises(MapFileError, match=r"^port\.map:1: replacement .* is invalid"):
        parse_map(f"^layers => {replacement}", "port.map")


# ------------------------------------------------------------------ read_map


def test_read_map(tmp_path: Path) -> None:
    """read_map parses a UTF-8 file."""
    path = tmp_path / "port.map"
    path.write_text(MAP, encoding="utf-8")
    assert read_map(path).module("layers.3.norm1") == "h.3.ln_1"
    assert read_map(str(path)).module("layers.3.norm1") == "h.3.ln_1"


def test_read_map_errors_name_the_file_and_line(tmp_path: Path) -> None:
    """Errors in a read file start with the file's path and the line number."""
    path = tmp_path / "port.map"
    path.write_text("a => b\n\n# c\nbroken\n", encoding="utf-8")
    with pytest.raises(MapFileError, match="expected 'REGEX => REPLACEMENT'") as info:
        read_map(path)
    assert str(info.value).startswith(f"{path}:4: ")


def test_read_map_missing_file(tmp_path: Path) -> None:
    """A missing map file raises MapFileError naming the file (not FileNotFoundError)."""
    path = tmp_path / "missing.map"
    with pytest.raises(MapFileError, match="cannot read the map file") as info:
        read_map(path)
    assert str(info.value).startswith(f"{path}: ")


def test_read_map_not_utf8(tmp_path: Path) -> None:
    """A file that is not UTF-8 raises MapFileError, not UnicodeDecodeError."""
    path = tmp_path / "latin1.map"
    path.write_bytes("caf\xe9 => cafe\n".encode("latin-1"))
    with pytest.raises(MapFileError, match="cannot read the map file"):
        read_map(path)


def test_read_map_directory(tmp_path: Path) -> None:
    """A directory given as the map file raises MapFileError."""
    with pytest.raises(MapFileError, match=re.escape(str(tmp_path))):
        read_map(tmp_path)


def test_two_port_parameters_mapped_to_one_bundle_name_are_refused(tmp_path: Path) -> None:
    """A rule catching a leftover module too (``^(old_)?fc2$ => fc2``) sends two port parameters to one record:
    one would be judged by the other's gradient (a chained MISMATCH that --isolate turned into MATCH). Refused in
    one line naming both; a parameter shared by two modules (tied weights) is one parameter, and is fine."""
    import torch
    from torch import nn

    from parity_harness.capture.record.recorder import capture_run
    from parity_harness.replay.compare.runner import compare_run
    from parity_harness.replay.reader import BundleReader

    class Net(nn.Module):
        def __init__(self, fc2: nn.Linear, old_fc2: nn.Linear | None = None) -> None:
            super().__init__()
            self.fc2 = fc2
            if old_fc2 is not None:
                self.old_fc2 = old_fc2  # never called

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(x)

    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    bundle = tmp_path / "b.h5"
    capture_run(Net(layer), (torch.randn(4, 3),), bundle, seed=0)
    rule = parse_map(r"^(old_)?fc2$ => fc2")
    with BundleReader(bundle) as reader, pytest.raises(MapFileError, match=r"'fc2\.weight' and 'old_fc2\.weight'"):
        compare_run(Net(layer, nn.Linear(3, 2)), reader, rename=rule)
    with BundleReader(bundle) as reader:
        assert compare_run(Net(layer, layer), reader, rename=rule).match


def _first_fitting_rule(rename: RenameMap, name: str, parameter: bool) -> str | None:
    """The rule semantics spelled out: the first rule, in order, fitting the whole name."""
    owner = name.rpartition(".")[0]
    for pattern, replacement in rename.rules:
        match = pattern.fullmatch(name)
        if match and not (parameter and pattern.fullmatch(owner)):
            return None if replacement == "-" else match.expand(replacement)
    return name


def test_literal_rules_are_looked_up_in_the_order_of_the_map() -> None:
    """A map saved by --map auto is one literal rule per module, looked up rather than matched one by one (a
    7,500-rule map took 14 s to map a large port's names): the first rule in the map's order still wins, whether
    literal or a pattern, for modules and parameters alike."""
    import random

    generator = random.Random(0)
    parts = ["a", "b", "layers", "0", "1", "attn", "norm"]
    names = sorted({".".join(generator.choice(parts) for _ in range(generator.randint(1, 4))) for _ in range(300)})
    lines = []
    for _ in range(60):
        target = generator.choice(names)
        if generator.random() < 0.6:
            lines.append(f"^{re.escape(target)}$ => lit.{target}")
        else:
            lines.append(f"^{re.escape(target.split('.')[0])}\\.(.*)$ => pat.\\1")
    lines.append(r"^(.*)\.norm$ => \1.ln")
    lines.append("^a$ => -")
    rename = parse_map("\n".join(lines))
    assert len(rename._literals) > 20  # type: ignore[attr-defined]
    for name in names:
        assert rename.module(name) == _first_fitting_rule(rename, name, parameter=False), name
        named, mapped = rename.named_parameter(name)
        expected = _first_fitting_rule(rename, name, parameter=True)
        assert (mapped if named else name) == expected, name


def test_unused_rules_looks_literal_rules_up_and_matches_the_others() -> None:
    """A literal rule (one path, as --save-map writes them) is used when that path is a port name, a pattern when it
    fits one: a 7,501-rule saved map took 2.4 s to check here."""
    from parity_harness.replay.naming.mapping import unused_rules

    rename = parse_map(
        "\n".join([r"^enc\.0$ => a", r"^enc\.9$ => b", r"^enc\.(\d+)\.lin$ => c.\1", r"^dec\.\d+$ => d"])
    )
    names = ["enc", "enc.0", "enc.0.lin", "enc.1"]
    assert unused_rules(rename, names) == [r"^enc\.9$ => b", r"^dec\.\d+$ => d"]


@pytest.mark.parametrize(
    ("pattern", "name"),
    [
        (r"^(.|.|.|.)*Z$", "encoder.layers.0.self_attn.linear_q"),  # a 22-byte map line that hung replay-compare
        (r"^(a+)+$", "a" * 40 + "!"),
        ("^" + ".{0,16}" * 10 + "X$", "encoder.layers.0.self_attn.linear_q"),  # no repetition inside another
        ("^" + "(?:a)?" * 28 + "a" * 28 + "$", "a" * 28),
    ],
    ids=["alternatives repeated", "repetition repeated", "bounded repetitions in a row", "optional items in a row"],
)
def test_a_rule_whose_matching_backtracks_is_stopped_in_one_line(
    pattern: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python's matcher backtracks: such a rule took exponential time on a name it does not match. In the main thread
    (the commands, a test suite) matching is timed, and a rule past the limit is refused naming itself and the name
    (MapFileError: exit 2) rather than running for hours."""
    from parity_harness.replay.naming import bounded

    monkeypatch.setattr(bounded, "LIMIT_SECONDS", 0.2)
    rename = parse_map(f"{pattern} => x")
    with pytest.raises(MapFileError, match=r"took over 0\.2 s matching"):
        rename.module(name)
    with pytest.raises(MapFileError, match=r"took over 0\.2 s matching"):
        unused_rules(rename, [name])


@pytest.mark.parametrize(
    "pattern",
    [
        r"^blocks\.(\d+)\.attn\.(q|k|v)_proj$",
        r"^(.*)\.layers\.(\d+)\.(.*)$",
        r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.w(\d+)$",
        r"^(?:[a-z_]+\.)*norm$",
    ],
)
def test_rules_of_the_usual_shapes_match_as_written(pattern: str) -> None:
    """Groups, alternatives, several repetitions and a repetition of a separated part: what maps are made of, none
    refused by the time limit or a test of their form (an earlier such test refused the last three)."""
    rename = parse_map(f"{pattern} => x")
    assert rename.module("a" * 1000) == "a" * 1000  # no match, quickly


def test_a_running_interval_timer_is_left_alone() -> None:
    """A timer the process already runs (pytest-timeout's) is neither replaced nor stopped: matching goes untimed."""
    import signal

    fired: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(signum))
    signal.setitimer(signal.ITIMER_REAL, 30.0)
    try:
        assert parse_map(r"^(.*)\.x$ => y").module("a.x") == "y"
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < remaining <= 30.0
        assert signal.getsignal(signal.SIGALRM) is not previous
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert fired == []


def test_a_rule_cannot_make_names_past_the_limit() -> None:
    """A replacement repeating a group (``\\1\\1\\1...``) made a name per path as long as the replacement times the
    path (3.2 GB of memory for a 4 MB map); names longer than any module path are not made."""
    with pytest.raises(MapFileError, match="replacement longer than 1024 characters"):
        parse_map("^(.*)$ => " + "\\1" * 600)
    doubling = parse_map("^(.*)$ => " + "\\1" * 20)
    assert doubling.module("a" * 51) == "a" * 1020
    with pytest.raises(MapFileError, match="a name of 1040 characters"):
        doubling.module("a" * 52)
    assert parse_map("^(.*)x$ => y").module("a" * 2000) == "a" * 2000  # a long name is matched, and kept


def test_a_map_line_holding_a_control_character_is_refused() -> None:
    """A replacement holding an escape sequence (``\\x1b[1A``: the cursor a line up) would redraw the report's lines
    where the mapped name is printed; tabs stay allowed between the parts of a rule."""
    with pytest.raises(MapFileError, match=r"^port\.map:2: holds a control character"):
        parse_map("^a$\t=> b\n^c$ => d\x1b[1ARESULT: MATCH\n", "port.map")
    assert parse_map("^a$\t=>\tb").module("a") == "b"
