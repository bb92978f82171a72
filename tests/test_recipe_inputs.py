"""Hostile or mistaken recipe and hostfile input (issue 17): environment keys that would reach a shell,
masked values copied back, alias bombs, booleans taken as numbers, absurd slot counts. Each is one line
naming the file, line or field, exit code 2, and fast."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from test_recipe import good
from zerorun.errors import ZerorunError
from zerorun.recipe.hostfile import parse_hostfile
from zerorun.recipe import MASK, load_recipe, masked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("key", ["X=1; touch /tmp/p; Y", "A B", "1X", "X-Y", "", "X$(id)", "é"])
def test_launch_env_keys_must_be_variable_names(tmp_path, key):
    with pytest.raises(ZerorunError, match=r"launch\.env: key .* is not a variable name") as info:
        load_recipe(good(tmp_path, "launch:\n  env:\n    " + repr(key).replace("'", '"') + ": '1'\n"))
    assert "\n" not in str(info.value) and info.value.exit_code == 2
    assert str(info.value).startswith(str(tmp_path / "r.yaml") + ":13: ")  # the env: line
    with pytest.raises(ZerorunError, match=r"^override .*: launch\.env: key .* is not a variable name"):
        load_recipe(good(tmp_path), ["launch.env={%s: '1'}" % json.dumps(key)])


def test_launch_env_values_stay_as_given_and_are_masked_on_disk(tmp_path):
    r = load_recipe(good(tmp_path, "launch:\n  env: {TOKEN: \"s3cret; $(id) 'q'\", _OK2: ''}\n"))
    assert r.launch.env == {"TOKEN": "s3cret; $(id) 'q'", "_OK2": ""}
    data = r.model_dump()
    assert masked(data)["launch"]["env"] == {"TOKEN": MASK, "_OK2": MASK}
    assert data["launch"]["env"]["TOKEN"] == "s3cret; $(id) 'q'"  # the original is left alone
    with pytest.raises(ZerorunError, match=r"r\.yaml:13: launch\.env: TOKEN is '<masked>', the mask zerorun "
                                           r"writes .*: give the real value"):
        load_recipe(good(tmp_path, f"launch:\n  env: {{TOKEN: '{MASK}'}}\n"))


BOMB = """\
a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
"""


@pytest.mark.parametrize("text,expected", [
    (BOMB, r"r\.yaml: invalid YAML: its aliases expand to more than 100000 nodes"),
    ("name: t\nmodel: {module: x.py, kwargs: {k: &k [1, *k]}}\n", r"r\.yaml: invalid YAML: an alias refers to itself"),
    ("a: " + "[" * 1000 + "]" * 1000 + "\n", r"r\.yaml: invalid YAML: nested too deeply"),
], ids=["alias-bomb", "recursive-alias", "too-deep"])
def test_unbounded_yaml_is_refused_quickly(tmp_path, text, expected):
    (tmp_path / "r.yaml").write_text(text)
    t0 = time.perf_counter()
    with pytest.raises(ZerorunError, match=expected):
        load_recipe(str(tmp_path / "r.yaml"))
    assert time.perf_counter() - t0 < 5


def test_a_few_aliases_are_still_fine(tmp_path):
    path = good(tmp_path, "zero: &z {stage: 2}\nlog: {every: 1, dir: runs}\n")
    (tmp_path / "r.yaml").write_text(open(path).read().replace("steps: 5", "steps: &n 5").replace(
        "micro_batch_size: 2", "micro_batch_size: *n"))
    r = load_recipe(path)
    assert r.zero.stage == 2 and r.train.steps == r.train.micro_batch_size == 5


@pytest.mark.parametrize("override,expected", [
    ("train.steps=true", r"^override 'train.steps=true': train\.steps: expected a number, got a boolean \(true\)$"),
    ("train.micro_batch_size=false", r"train\.micro_batch_size: expected a number, got a boolean \(false\)"),
    ("zero.stage=true", r"zero\.stage: expected a number, got a boolean \(true\)"),
    ("train.optimizer.lr=true", r"train\.optimizer\.lr: expected a number, got a boolean"),
    ("train.grad_clip=true", r"train\.grad_clip: expected a number, got a boolean"),
    ("zero.bucket_mb=true", r"zero\.bucket_mb: expected a number"),
    ("launch.procs_per_node=true", r"launch\.procs_per_node: expected ranks per node .*; got a boolean \(true\)$"),
    ("checkpoint.every=true", r"checkpoint\.every: expected a number"),
    ("train.optimizer.betas=[true, 0.9]", r"train\.optimizer\.betas: expected a number, got a boolean \(\[true, 0\.9\]\)"),
    ("train.optimizer.eps=false", r"train\.optimizer\.eps: expected a number, got a boolean \(false\)"),
    ("launch.procs_per_node=100000000000000000000", r"launch\.procs_per_node: expected ranks per node from 1 to 4096, "
                                                     r"or gpu .*; got 100000000000000000000$"),
    # infinite or NaN numbers passed among the optimizer's arguments and reached the ranks as JSON null
    ("train.optimizer.eps=1e400", r"train\.optimizer\.eps: expected a finite number, got inf$"),
    ("train.optimizer.betas=[.inf, 0.9]", r"train\.optimizer\.betas: item 0: expected a finite number, got inf$"),
    ("train.optimizer.eps=1" + "0" * 400, r"train\.optimizer\.eps: expected a finite number, got a whole number of 401 "),
    ("model.kwargs.rev=12e4567", r"model\.kwargs: rev: expected a finite number, got inf$"),
    ("model.kwargs={a: {b: [1, .nan]}}", r"model\.kwargs: a\.b\.1: expected a finite number, got nan$"),
    ("data.kwargs.x=-.inf", r"data\.kwargs: x: expected a finite number, got -inf$"),
    ("train.optimizer.lr=.inf", r"train\.optimizer\.lr: Input should be a finite number"),
    ("train.optimizer.weight_decay=1e400", r"train\.optimizer\.weight_decay: Input should be a finite number"),
    # a quoted number reached the optimizer as text and failed on the ranks, after the launch
    ('train.optimizer.eps="1e-8"', r"train\.optimizer\.eps: '1e-8' is text \(quoted\?\): numbers and true/false are "
                                   r"written without quotes$"),
    ("train.optimizer={name: SGD, lr: 0.1, momentum: '0.9'}", r"train\.optimizer\.momentum: '0\.9' is text"),
    ('train.optimizer.betas=["0.9", 0.999]', r"train\.optimizer\.betas: item 0: '0\.9' is text \(quoted\?\)"),
    # a quoted boolean is a non-empty string: maximize: "false" trained with maximize on
    ("train.optimizer.maximize='false'", r"train\.optimizer\.maximize: 'false' is text \(quoted\?\)"),
    ("train.optimizer={name: SGD, lr: 0.1, momentum: 0.9, nesterov: 'Off'}", r"\.nesterov: 'Off' is text"),
    # anything else given for a boolean is read for its truth too: the optimizer's own argument check
    ("train.optimizer.maximize='yes please'", r"train\.optimizer\.maximize: expected true or false, got \"yes please\"$"),
    ("train.optimizer.maximize=[false]", r"train\.optimizer\.maximize: expected true or false, got \[false\]$"),
    ("train.optimizer.amsgrad=2", r"train\.optimizer\.amsgrad: expected true or false, got 2$"),
    ("train.optimizer.foreach=nope", r"train\.optimizer\.foreach: expected true or false or null, got \"nope\"$"),
    # text that YAML never reads as a number (Python's float does): the argument check, not "without quotes"
    ("train.optimizer.eps='0x10'", r"train\.optimizer\.eps: expected a number, got text \(\"0x10\"\)$"),
    ("train.optimizer.eps=Infinity", r"train\.optimizer\.eps: expected a number, got text \(\"Infinity\"\)$"),
    # the user's key is shown as written, never filled in as a template
    ('model.kwargs={"{shown}": .inf}', r"model\.kwargs: \{shown\}: expected a finite number, got inf$"),
    ('train.optimizer.betas=[{"{text}": "0.9"}, 0.99]', r"\.betas: item 0\.\{text\}: '0\.9' is text"),
    # a field of numbered choices: was "Input should be 0, 1, 2 or 3", which reads as if 2 were refused
    ("zero.stage='2'", r"^override \"zero\.stage='2'\": zero\.stage: '2' is text \(quoted\?\): expected 0, 1, 2 or 3$"),
    ("zero.stage='2.0'", r"zero\.stage: '2\.0' is text \(quoted\?\): expected 0, 1, 2 or 3$"),
    ("zero.stage='5'", r"zero\.stage: Input should be 0, 1, 2 or 3$"),  # unquoted it is refused too: no hint
    ("zero=off", r"^override 'zero=off': zero: expected a mapping, got a boolean \(false\)"),  # was "a number"
    ("zero.stage=5", r"zero\.stage: Input should be 0, 1, 2 or 3$"),
    ("precision=fp8", r"precision: Input should be 'fp32', 'bf16' or 'fp16'$"),
    # a field of text given an unquoted yes/no/on/off: was "expected a number, got a boolean"
    ("precision=off", r"^override 'precision=off': precision: expected 'fp32', 'bf16' or 'fp16', got a boolean "
                      r"\(false\): YAML reads an unquoted yes/no/on/off/true/false as one$"),
    ("zero.offload_optimizer=no", r"zero\.offload_optimizer: expected 'none', 'cpu' or 'disk', got a boolean \(false\)"),
    ("zero.grad_accum_dtype=off", r"zero\.grad_accum_dtype: expected 'fp32', 'bf16' or 'fp16', got a boolean"),
    ("model.task=yes", r"model\.task: expected 'causal-lm', got a boolean \(true\)"),
    ("name=yes", r"^override 'name=yes': name: expected text, got a boolean \(true\): YAML reads"),
    # a quoted number in a field of text choices is not told to lose its quotes; lists are not "text"
    ("precision='16'", r"precision: Input should be 'fp32', 'bf16' or 'fp16'$"),
    ("zero.units=yes", r"zero\.units: expected a list, got a boolean \(true\): YAML reads"),  # was "text"
    ("launch.env=on", r"launch\.env: expected a mapping, got a boolean \(true\)"),
])
def test_booleans_are_not_numbers(tmp_path, override, expected):
    with pytest.raises(ZerorunError, match=expected) as info:
        load_recipe(good(tmp_path), [override])
    assert info.value.exit_code == 2 and "\n" not in str(info.value)


def test_every_bad_optimizer_argument_on_its_own_line_at_its_key(tmp_path):
    """The optimizer's extra arguments are checked one by one: a quoted number, a quoted boolean and a
    non-finite number are each reported on their own line, at the key's line of the recipe (not the
    ``optimizer:`` line), beside a declared field's error; a quoted number in a declared float field (``lr``)
    is read as the number, as pydantic reads it."""
    path = good(tmp_path)
    text = open(path).read()
    assert "  optimizer: {name: AdamW, lr: 1.0e-3, betas: [0.9, 0.95]}\n" in text
    block = ("  optimizer:\n    name: AdamW\n    lr: 0\n    betas: [0.9, \"0.95\"]\n    eps: \"1e-8\"\n"
             "    maximize: \"false\"\n    rho: .inf\n")
    (tmp_path / "r.yaml").write_text(text.replace("  optimizer: {name: AdamW, lr: 1.0e-3, betas: [0.9, 0.95]}\n", block))
    lines = (tmp_path / "r.yaml").read_text().splitlines()
    at = {key: lines.index(next(x for x in lines if x.strip().startswith(key + ":"))) + 1
          for key in ("lr", "betas", "eps", "maximize", "rho")}
    with pytest.raises(ZerorunError) as info:
        load_recipe(str(tmp_path / "r.yaml"))
    assert info.value.exit_code == 2
    assert [x.removeprefix(str(tmp_path / "r.yaml")) for x in str(info.value).splitlines()] == [
        f":{at['lr']}: train.optimizer.lr: Input should be greater than 0",
        f":{at['betas']}: train.optimizer.betas: item 1: '0.95' is text (quoted?): numbers and true/false are "
        "written without quotes",
        f":{at['eps']}: train.optimizer.eps: '1e-8' is text (quoted?): numbers and true/false are written "
        "without quotes",
        f":{at['maximize']}: train.optimizer.maximize: 'false' is text (quoted?): numbers and true/false are "
        "written without quotes",
        f":{at['rho']}: train.optimizer.rho: expected a finite number, got inf"], str(info.value)
    # the optimizer's own argument check names the key's line too (it named the optimizer: line)
    (tmp_path / "r.yaml").write_text(text.replace("  optimizer: {name: AdamW, lr: 1.0e-3, betas: [0.9, 0.95]}\n",
                                                  "  optimizer:\n    name: AdamW\n    amsgrad: 2\n"))
    lines = (tmp_path / "r.yaml").read_text().splitlines()
    line = lines.index("    amsgrad: 2") + 1
    with pytest.raises(ZerorunError, match=rf"r\.yaml:{line}: train\.optimizer\.amsgrad: expected true or false"):
        load_recipe(str(tmp_path / "r.yaml"))
    r = load_recipe(path, ["train.optimizer={name: SGD, lr: '0.5', momentum: 0.9, nesterov: true, foreach: null}"])
    assert r.train.optimizer.kwargs() == {"lr": 0.5, "weight_decay": 0.0, "momentum": 0.9, "nesterov": True,
                                          "foreach": None}


def test_booleans_where_booleans_belong(tmp_path):
    r = load_recipe(good(tmp_path), ["train.optimizer.amsgrad=true", "zero.prefetch=false",
                                     "train.optimizer.decay_1d=true"])
    assert r.train.optimizer.kwargs()["amsgrad"] is True and r.zero.prefetch is False
    (tmp_path / "r.yaml").write_text(open(good(tmp_path)).read().replace("steps: 5", "steps: true"))
    with pytest.raises(ZerorunError, match=r"r\.yaml:9: train\.steps: expected a number, got a boolean \(true\)"):
        load_recipe(str(tmp_path / "r.yaml"))


@pytest.mark.parametrize("text,expected", [
    ("a slots=2\nb slots=100000000000000000000\n", r"^hf:2: b: slots=100000000000000000000 is more than 4096"),
    ("a slots=10**20\n", r"^hf:1: a: slots must be a positive integer, got '10\*\*20'$"),
    ("a slots=4097\n", r"^hf:1: a: slots=4097 is more than 4096"),
])
def test_absurd_slot_counts_are_refused(text, expected):
    with pytest.raises(ZerorunError, match=expected):
        parse_hostfile(text, "hf")
    assert parse_hostfile("a slots=4096\n", "hf")[0].slots == 4096


def test_cli_exit_2_for_each(tmp_path):
    """Through the command line: one line on stderr and exit code 2 (--dry-run: nothing starts)."""
    (tmp_path / "hf").write_text("localhost slots=100000000000000000000\n")
    (tmp_path / "bomb.yaml").write_text(BOMB)
    for args, expected in (
            (["train", "recipes/tiny.yaml", "-H", str(tmp_path / "hf"), "--dry-run"], "hf:1: localhost: slots="),
            (["train", str(tmp_path / "bomb.yaml"), "--dry-run"], "alias bomb"),
            (["train", "recipes/tiny.yaml", "train.steps=true", "--dry-run"], "train.steps: expected a number"),
            (["train", "recipes/tiny.yaml", "launch.env={'X=1; touch /tmp/p; Y': '1'}", "--dry-run"],
             "is not a variable name"),
            (["train", "recipes/tiny.yaml", "--num-procs", "100000000000000000000", "--dry-run"], "--num-procs")):
        out = subprocess.run([sys.executable, "-m", "zerorun", *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and expected in out.stderr, (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_run_folder_recipe_masks_env_values(tmp_path):
    import yaml

    from zerorun.recipe import masked_yaml

    r = load_recipe(good(tmp_path, "launch:\n  env: {TOKEN: s3cret}\n"))
    text = masked_yaml(r)
    assert "s3cret" not in text and yaml.safe_load(text)["launch"]["env"] == {"TOKEN": MASK}
    (tmp_path / "copied.yaml").write_text(text)  # a run folder's recipe.yaml used again is refused, not masked
    with pytest.raises(ZerorunError, match=r"launch\.env: TOKEN is '<masked>'.*give the real value"):
        load_recipe(str(tmp_path / "copied.yaml"))


@pytest.mark.parametrize("key", ["X\n", "X\r\n", "NCCL_X\n", "X\0"])
def test_launch_env_key_with_a_final_newline_is_refused(tmp_path, key):
    """``^...$`` let a name with a final newline through; the remote script then ran a line of its own."""
    with pytest.raises(ZerorunError, match=r"launch\.env: key .* is not a variable name") as info:
        load_recipe(good(tmp_path), ["launch.env={%s: '1'}" % json.dumps(key)])
    assert "\n" not in str(info.value) and info.value.exit_code == 2


def test_launch_env_value_with_a_nul_byte_is_refused_at_load(tmp_path):
    with pytest.raises(ZerorunError, match=r"r\.yaml:13: launch\.env: X: the value holds a NUL byte") as info:
        load_recipe(good(tmp_path, 'launch:\n  env: {X: "a\\0b"}\n'))
    assert "\n" not in str(info.value) and info.value.exit_code == 2


def test_launch_env_value_above_linux_limit_is_refused_at_load(tmp_path):
    from zerorun.recipe import MAX_ENV_STRING

    big = "x" * MAX_ENV_STRING
    with pytest.raises(ZerorunError, match=rf"r\.yaml:13: launch\.env: BIG: KEY=VALUE is {MAX_ENV_STRING + 5} "
                                           r"bytes, above Linux's limit .*\(MAX_ARG_STRLEN\)") as info:
        load_recipe(good(tmp_path, f"launch:\n  env: {{BIG: {big}}}\n"))
    assert "\n" not in str(info.value) and info.value.exit_code == 2
    assert load_recipe(good(tmp_path, f"launch:\n  env: {{BIG: {big[:-6]}}}\n")).launch.env["BIG"] == big[:-6]


def test_launch_env_numbers_are_taken_as_their_text(tmp_path):
    """``OMP_NUM_THREADS: 1`` was refused with "Input should be a valid string": numbers are their text (as
    written in the file; decimal text for an override), as docker-compose takes them."""
    r = load_recipe(good(tmp_path, "launch:\n  env: {OMP_NUM_THREADS: 1, NCCL_DEBUG: 010, RATIO: 1.50, S: x}\n"))
    assert r.launch.env == {"OMP_NUM_THREADS": "1", "NCCL_DEBUG": "010", "RATIO": "1.50", "S": "x"}
    r = load_recipe(good(tmp_path), ["launch.env.NCCL_DEBUG=1", "launch.env.F=2.5", "launch.env.Z=007"])
    assert r.launch.env == {"NCCL_DEBUG": "1", "F": "2.5", "Z": "007"}
    assert load_recipe(good(tmp_path), ["launch.env={A: 3}"]).launch.env == {"A": "3"}


@pytest.mark.parametrize("value,expected", [
    ("true", r"X: true is a YAML boolean, not text: quote the value: 'launch\.env\.X: \"true\"'"),
    ("yes", r"X: true is a YAML boolean, not text: quote the value"),
    ("null", r"X has no value \(null\): give its text"),
    ("", r"X has no value \(null\)"),
    ("[1, 2]", r"X is a list, not text: an environment value is one string; quote it"),
    ("{a: 1}", r"X is a mapping, not text"),
])
def test_launch_env_values_that_are_not_text_say_how_to_quote(tmp_path, value, expected):
    with pytest.raises(ZerorunError, match=r"r\.yaml:13: launch\.env: " + expected) as info:
        load_recipe(good(tmp_path, f"launch:\n  env: {{X: {value}}}\n"))
    assert "\n" not in str(info.value) and info.value.exit_code == 2


def test_exponent_notation_without_a_dot_is_a_number(tmp_path):
    """YAML 1.1 (PyYAML) reads ``1e-8`` and ``5e8`` as strings: ``eps: 1e-8`` reached AdamW as text and
    ``zero.prefetch_bytes: 5e8`` was refused. They are numbers, as in YAML 1.2, JSON and DeepSpeed's configs,
    in the file and in overrides; a whole number fills an integer field, a fraction there is an error."""
    text = open(good(tmp_path)).read().replace("lr: 1.0e-3", "lr: 1e-3, eps: 1e-8").replace("steps: 5", "steps: 1e1")
    (tmp_path / "e.yaml").write_text(text + "zero: {stage: 3, prefetch_bytes: 5e8, persistence_threshold: 1E+5, "
                                            "bucket_mb: 2.5e1}\nlaunch:\n  env: {A: 1e5, B: 1_0e2}\n")
    r = load_recipe(str(tmp_path / "e.yaml"))
    assert r.train.optimizer.kwargs()["eps"] == 1e-8 and r.train.optimizer.lr == 1e-3 and r.train.steps == 10
    assert (r.zero.prefetch_bytes, r.zero.persistence_threshold, r.zero.bucket_mb) == (500_000_000, 100_000, 25.0)
    assert type(r.zero.prefetch_bytes) is int and type(r.train.steps) is int
    assert r.launch.env == {"A": "1e5", "B": "1_0e2"}  # environment values keep their text
    r = load_recipe(good(tmp_path), ["zero.stage=3", "zero.prefetch_bytes=1e9", "train.optimizer.weight_decay=1e-2",
                                     "name=1e5x", "launch.env.C=2e3"])
    assert (r.zero.prefetch_bytes, r.train.optimizer.weight_decay, r.name, r.launch.env) == \
        (10**9, 0.01, "1e5x", {"C": "2e3"})
    for override, expected in [("zero.prefetch_bytes=1.5e0", r"zero\.prefetch_bytes: .*fractional part"),
                               ("train.steps=-1e1", r"train\.steps: Input should be greater than 0")]:
        with pytest.raises(ZerorunError, match=expected) as info:
            load_recipe(good(tmp_path), ["zero.stage=3", override])
        assert info.value.exit_code == 2 and "\n" not in str(info.value)


def test_prefetch_bytes_beside_prefetch_false_is_an_error(tmp_path):
    """``zero.prefetch: false`` with ``zero.prefetch_bytes`` set was silent (the bytes were ignored)."""
    (tmp_path / "p.yaml").write_text(open(good(tmp_path)).read() + "zero:\n  stage: 3\n  prefetch: false\n"
                                     "  prefetch_bytes: 1000000\n")
    with pytest.raises(ZerorunError, match=r"p\.yaml:\d+: zero\.prefetch_bytes: set while zero\.prefetch is "
                                           r"false") as info:
        load_recipe(str(tmp_path / "p.yaml"))
    assert info.value.exit_code == 2 and "\n" not in str(info.value)
    assert load_recipe(str(tmp_path / "p.yaml"), ["zero.prefetch=true"]).zero.prefetch_bytes == 10**6


def test_launch_env_numbers_keep_their_text_in_mapping_overrides_and_merges(tmp_path):
    """A whole ``launch.env`` mapping given as an override (``launch.env={X: 1e5}``, ``launch={env: ...}``) or
    reached through a YAML merge key kept numbers as Python wrote them (``100000.0``, ``8`` for ``010``)."""
    for override in ("launch.env={X: 1e5, Y: 010, Z: 1.50, S: s}", "launch={env: {X: 1e5, Y: 010, Z: 1.50, S: s}}"):
        assert load_recipe(good(tmp_path), [override]).launch.env == {"X": "1e5", "Y": "010", "Z": "1.50", "S": "s"}
    (tmp_path / "m.yaml").write_text(open(good(tmp_path)).read() + "launch:\n  env:\n    <<: [{A: 1e5, B: 010}, "
                                     "{A: 7, D: 0x1F}]\n    C: 2e3\n")
    assert load_recipe(str(tmp_path / "m.yaml")).launch.env == {"A": "1e5", "B": "010", "C": "2e3", "D": "0x1F"}
    # the value YAML keeps is the one whose text is kept: the last of duplicate keys, the later of two merges
    for override in ("launch.env={X: 1.0, X: 2.50}", "launch.env={<<: {X: 010}, <<: {X: 2.50}}",
                     "launch={env: {X: 1.0}, env: {X: 2.50}}"):
        assert load_recipe(good(tmp_path), [override]).launch.env == {"X": "2.50"}, override


@pytest.mark.parametrize("value", ["0", "auto", "1e0", "-2", "1.5"])
def test_omp_num_threads_must_be_a_positive_whole_number(tmp_path, monkeypatch, value):
    """``launch.env: {OMP_NUM_THREADS: 0}`` (or ``auto``, ``1e0``) launched the job and every rank died in
    ``torch.set_num_threads`` with a traceback: the recipe and an environment file now say so before anything
    starts. The launcher's own value never reaches a rank: each node's plan sets it."""
    from zerorun.recipe.hostfile import Host
    from zerorun.launch.env import parse_env_file
    from zerorun.launch.plan import build_plan

    with pytest.raises(ZerorunError, match=r"launch\.env: OMP_NUM_THREADS is .*: expected a positive whole "
                                           r"number of threads") as info:
        load_recipe(good(tmp_path), [f"launch.env.OMP_NUM_THREADS={value}"])
    assert info.value.exit_code == 2 and "\n" not in str(info.value)
    with pytest.raises(ZerorunError, match=r"^\.zerorun_env:2: OMP_NUM_THREADS is "):
        parse_env_file(f"# threads\nOMP_NUM_THREADS={value}\n", ".zerorun_env")
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    [node] = build_plan([Host("localhost", 2)], None, "t", 29500, program=["true"], cpus={"localhost": 4}).nodes
    assert node.env["OMP_NUM_THREADS"] == "2"
    for good_value in ("4", " 2 ", ""):  # empty: unset
        assert parse_env_file(f"OMP_NUM_THREADS={good_value}\n") == {"OMP_NUM_THREADS": good_value}


def test_a_text_where_a_list_belongs_says_how_to_write_the_list(tmp_path):
    """``zero.units: Block`` (no brackets), in the file or as an override: one line showing the list (before:
    pydantic's "Input should be a valid list", which named no way out)."""
    with pytest.raises(ZerorunError, match=r"^override 'zero\.units=Block': zero\.units: expected a list: \[Block\] "
                                           r"\(got the text 'Block'\)$"):
        load_recipe(good(tmp_path), ["zero.stage=3", "zero.units=Block"])
    with pytest.raises(ZerorunError, match=r"^override 'data\.paths=a\.txt': data\.paths: expected a list: "
                                           r"\[a\.txt\] \(got the text 'a\.txt'\)$"):
        load_recipe(good(tmp_path), ["data.paths=a.txt"])
