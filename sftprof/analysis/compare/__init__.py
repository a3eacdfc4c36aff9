"""Comparison of two runs: the report (runs), its verdicts, the statistics behind them and the settings that differ."""
