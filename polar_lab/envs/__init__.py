"""Other frameworks' environments, run through polar_lab (docs/harnesses.md): each lives in its own venv and is
driven over HTTP or a pipe, so nothing here imports it.

- `polar_lab.envs.nemo_gym`: NeMo Gym resources servers as tasks, Gym's own agent on the Lab, rows for NeMo RL.
- `polar_lab.envs.verifiers`: a verifiers taskset's rollouts as `lab.rollout` runs, one session each.
"""
