# Sourced by .ci/run: a real single-node SLURM (launch/local_slurm.sh) for tests/test_slurm.py.
# `up` installs slurm-wlm, munge, slurmdbd and mariadb-server when missing (~1 min on a fresh machine),
# then starts the daemons and waits until the node is idle; `down` cancels jobs and stops them all.

ci_up_slurm() {
    bash launch/local_slurm.sh up
}

ci_down_slurm() {
    bash launch/local_slurm.sh down
}
