"""bisect --jobs walks the ranks' streams at once and gives the one-thread answer byte for byte."""

import json

from click.testing import CliRunner

from tdiff.bisect import bisect_dumps
from tdiff.cli import cli
from tests.compare.test_parallel import ranked_dump


def test_bisect_over_ranks_names_the_one_thread_culprit(tmp_path):
    a, b = ranked_dump(tmp_path / "a"), ranked_dump(tmp_path / "b", planted=(3, 1, 11))
    results = [json.dumps(bisect_dumps(a, b, jobs=jobs).to_json()) for jobs in (1, 4)]
    assert results[0] == results[1]
    found = json.loads(results[0])["first_divergence"]
    assert found["rank"] == 3 and found["module"] == "2"   # the planted rank's second Linear
    runner = CliRunner()
    printed = [runner.invoke(cli, ["bisect", str(a), str(b), "--json", "--jobs", str(jobs)]) for jobs in (1, 3)]
    assert [p.exit_code for p in printed] == [1, 1] and printed[0].stdout == printed[1].stdout
