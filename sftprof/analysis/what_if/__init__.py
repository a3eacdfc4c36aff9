"""What-ifs of a trial: the changes worth trying (changes), the recompute plan, the next step of each finding, and a
what-if tried against its prediction (outcome)."""
