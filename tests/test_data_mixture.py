"""``train { data = [0.7, "web.tokens", 0.3, "code.tokens"] }`` (issue 38): weighted
mixtures of token files, each sample's source chosen as Megatron-LM's blended datasets
choose it (planc.data.blend), the samples of a step a function of the seed and the step
alone, each source's share in the metrics."""

from __future__ import annotations

import json

import pytest

from planc.cli import main
from planc.data.blend import BLOCK, source_of, samples_taken
from planc.data.tokens import write_tokens
from planc.lang import load_file

WEB, CODE, BOOKS = range(0, 20), range(20, 40), range(40, 60)  # each source's ids


def write_sources(directory) -> None:
    for name, ids in (("web", WEB), ("code", CODE), ("books", BOOKS)):
        write_tokens(directory / f"{name}.tokens", [ids[i % 20] for i in range(997)], 2)


def plan_text(data: str, mesh: str = "dp = 2", steps: int = 4, batch: int = 8,
              shuffle: bool = False) -> str:
    return (f"plan mix {{\n  model gpt {{ layers = 2; hidden = 16; heads = 2; vocab = 64; "
            f"seq = 7; batch = {batch} }}\n  mesh {{ {mesh} }}\n  train {{ steps = {steps}; "
            f"optimizer = sgd(lr = 0.1); seed = 5; data = {data}"
            f"{'; shuffle = on' if shuffle else ''} }}\n}}\n")


TWO = '[0.7, "web.tokens", 0.3, "code.tokens"]'
THREE = '[5, "web.tokens", 3, "code.tokens", 2, "books.tokens"]'


def test_megatrons_rule_gives_each_source_its_weight_and_its_own_sample_order():
    weights = (0.5, 0.3, 0.2)
    seen, last = [0, 0, 0], [-1, -1, -1]
    for j in range(3 * BLOCK + 17):
        d, i = source_of(j, weights)
        assert i == seen[d] == last[d] + 1  # each source read in its own order, no gap
        seen[d] += 1
        last[d] = i
        assert tuple(seen) == samples_taken(j + 1, weights)
    # the first samples as build_blending_indices chooses them (sample p: the source whose
    # share lags its weight most at max(p, 1), ties to the first)
    assert [source_of(j, weights)[0] for j in range(10)] == [0, 1, 2, 0, 1, 0, 2, 0, 1, 0]
    for count in (100, 1000, 10_000):  # a share within one sample of its weight, twice
        taken = samples_taken(count, weights)
        assert all(abs(n - w * count) <= 2 for n, w in zip(taken, weights)), (count, taken)


@pytest.mark.parametrize("data, weights", [(TWO, (0.7, 0.3)), (THREE, (0.5, 0.3, 0.2))],
                         ids=["two", "three"])
@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffled"])
def test_the_measured_share_of_each_source_over_1000_samples_is_its_weight(
        data, weights, shuffle, tmp_path):
    pytest.importorskip("torch")
    from planc.runtime.engine.data import batch_tokens

    write_sources(tmp_path)
    (tmp_path / "p.plan").write_text(plan_text(data, batch=10, shuffle=shuffle))
    plan = load_file(tmp_path / "p.plan").plan
    counts = [0, 0, 0]
    for step in range(100):  # 1,000 samples
        for row in batch_tokens(plan, step).tolist():
            source = row[0] // 20
            assert all(t // 20 == source for t in row)  # a sample is one source's
            counts[source] += 1
    shares = [n / 1000 for n in counts[:len(weights)]]
    assert all(abs(share - w) <= 0.02 for share, w in zip(shares, weights)), shares
    assert counts[:len(weights)] == list(samples_taken(1000, weights))
    # a step's samples depend on the seed and the step alone
    assert batch_tokens(plan, 63).tolist() == batch_tokens(plan, 63).tolist()


@pytest.mark.slow
def test_a_run_resumed_under_another_layout_continues_the_same_samples(tmp_path, capfd):
    pytest.importorskip("torch")
    write_sources(tmp_path)
    (tmp_path / "whole.plan").write_text(plan_text(THREE, steps=4))
    assert main(["run", str(tmp_path / "whole.plan"), "-o", str(tmp_path / "b1"),
                 "--metrics", str(tmp_path / "whole.jsonl")]) == 0
    whole = [json.loads(line) for line in (tmp_path / "whole.jsonl").read_text().splitlines()]
    assert whole[-1]["data_share"] == {str(tmp_path / f"{n}.tokens"): s for n, s in
                                       (("web", 0.5), ("code", 0.3125), ("books", 0.1875))}
    (tmp_path / "first.plan").write_text(plan_text(THREE, steps=4))
    assert main(["run", str(tmp_path / "first.plan"), "-o", str(tmp_path / "b2"), "--steps",
                 "2", "--checkpoint-dir", str(tmp_path / "ckpt")]) == 0
    (tmp_path / "then.plan").write_text(plan_text(THREE, mesh="tp = 2", steps=4))
    assert main(["run", str(tmp_path / "then.plan"), "-o", str(tmp_path / "b3"), "--resume",
                 str(tmp_path / "ckpt"), "--metrics", str(tmp_path / "then.jsonl")]) == 0
    assert "resumed from" in capfd.readouterr().err
    then = [json.loads(line) for line in (tmp_path / "then.jsonl").read_text().splitlines()]
    assert [r["step"] for r in then] == [2, 3]
    assert [r["loss"] for r in then] == pytest.approx([r["loss"] for r in whole[2:]],
                                                      rel=1e-5)


@pytest.mark.parametrize("data, message", [
    ('[0.7, "web.tokens"]', "error: a mixture is a weight before each of at least two "
                            "token files"),
    ('[0.7, "web.tokens", 0.3]', "error: a mixture is a weight before each of at least two "
                                 "token files"),
    ('[0.7, "web.tokens", 0.3, code]', "error: expected a token file's path in quotes after "
                                       "each weight"),
    ('[0, "web.tokens", 1, "code.tokens"]', "error: expected a number > 0, got 0"),
    ('[0.7, "web.tokens", 0.3, "odd.tokens"]', "error: data file 'odd.tokens' has an odd "
                                               "size (3 bytes); expected little-endian uint16 "
                                               "tokens"),
], ids=["one-source", "no-path", "a-word", "zero-weight", "a-damaged-source"])
def test_a_wrong_mixture_is_an_error_where_it_is_wrong(data, message, tmp_path, capfd):
    write_sources(tmp_path)
    (tmp_path / "odd.tokens").write_bytes(b"abc")
    (tmp_path / "p.plan").write_text(plan_text(data))
    assert main(["check", str(tmp_path / "p.plan")]) == 1
    err = capfd.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_missing_source_is_a_warning_at_its_path(tmp_path, capfd):
    write_sources(tmp_path)
    (tmp_path / "p.plan").write_text(plan_text('[0.7, "web.tokens", 0.3, "later.tokens"]'))
    assert main(["check", str(tmp_path / "p.plan")]) == 0
    err = capfd.readouterr().err
    column = plan_text('[0.7, "web.tokens", 0.3, "later.tokens"]').splitlines()[3].index(
        '"later') + 1
    assert f"p.plan:4:{column}: warning: data file 'later.tokens' does not exist (yet); " \
           f"planc run will need it" in err
