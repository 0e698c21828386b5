"""benchmarks/compare_seeds.py: the several-seed table of same-data comparisons, read back from results.jsonl files."""

import json
import statistics

import pytest

from benchmarks import compare_seeds


def write_run(path, ce_by_model, cycles=(1, 2)):
    path.mkdir()
    with open(path / "results.jsonl", "w") as f:
        for cycle in cycles:
            for model, ce in ce_by_model.items():
                recurrent = model.startswith("recurrent")
                f.write(json.dumps({"cycle": cycle, "model": model, "ce": ce + (2 - cycle),
                                    "kind": "recurrent" if recurrent else "transformer",
                                    "num_steps": int(model.split("n=")[1]) if recurrent else None}) + "\n")


def test_three_seeds_give_means_spreads_and_paired_differences(tmp_path, capsys):
    runs = []
    for seed, (n4, n12, base) in enumerate([(3.33, 3.30, 3.42), (3.24, 3.21, 3.45), (3.30, 3.28, 3.40)]):
        write_run(tmp_path / f"s{seed}", {"recurrent-125m n=4": n4, "recurrent-125m n=12": n12,
                                          "recurrent-125m n=24": n12 + 0.001, "transformer-125m": base})
        runs.append(str(tmp_path / f"s{seed}"))
    out = tmp_path / "seeds.md"
    assert compare_seeds.main([*runs, "--output", str(out)]) == 0
    cycle, ce, differences = compare_seeds.summarize(compare_seeds.read_runs(runs))
    assert cycle == 2 and ce["transformer-125m"] == pytest.approx([3.42, 3.45, 3.40])
    gap = differences["recurrent-125m n=12 minus transformer-125m"]
    assert gap == pytest.approx([-0.12, -0.24, -0.12])
    # every depth against each shallower one: n = 12 against n = 4 also where a deeper one was evaluated
    assert differences["recurrent-125m n=12 minus recurrent-125m n=4"] == pytest.approx([-0.03, -0.03, -0.02])
    assert differences["recurrent-125m n=24 minus recurrent-125m n=12"] == pytest.approx([0.001] * 3)
    assert len([name for name in differences if name.count("recurrent") == 2]) == 3
    text = out.read_text()
    assert f"{statistics.mean(gap):+.4f} | {statistics.stdev(gap):.4f} | 0.1200" in text
    assert text == capsys.readouterr().out.rstrip("\n") + "\n"
    # An earlier cycle on request; a cycle not finished everywhere or a missing run is refused naming the fix.
    assert compare_seeds.summarize(compare_seeds.read_runs(runs), 1)[1]["transformer-125m"] == pytest.approx(
        [4.42, 4.45, 4.40])
    with pytest.raises(SystemExit, match="--cycle 3 is not finished in every run"):
        compare_seeds.main([*runs, "--cycle", "3"])
    with pytest.raises(SystemExit, match="results.jsonl not found: pass the --output_dir"):
        compare_seeds.main([*runs, str(tmp_path / "missing")])
