"""Load shapes: how many users, when; and open-loop arrival schedules."""
