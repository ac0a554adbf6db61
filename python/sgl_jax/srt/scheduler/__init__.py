"""The scheduler process: the loop, one DP rank, admission, output processing, scoring, sessions, DP assignment."""
