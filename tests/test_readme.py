"""README.md holds exactly two quick-start commands; .ci/run runs the test one verbatim."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_two_quick_start_commands_and_ci_runs_the_test_command():
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert len(blocks) == 2 and all(len(b.strip().splitlines()) == 1 for b in blocks)
    run_cmd, test_cmd = (b.strip() for b in blocks)
    assert "run_qwen3_30b_a3b_sft_profile.sh" in run_cmd and "CONFIG=tiny_cpu" in run_cmd
    assert "pytest" in test_cmd
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_cmd in ci_lines
