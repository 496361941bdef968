# Sourced by .ci/with_services.sh: a real single-node SLURM (tests/cluster/local_slurm.sh) for the whole
# session. `up` installs slurm-wlm, munge, slurmdbd and mariadb-server when missing (~1 min on a fresh
# machine), then starts the daemons and waits until the node is idle; `down` cancels jobs and stops
# them all. tests/system/test_multinode.py turns it into a 2-node cluster (network namespaces) for its own
# tests, takes that down, and brings this 1-node cluster back for the tests after it: the other SLURM
# tests reach services on the host's loopback, which a node in its own namespace cannot.

ci_up_slurm() {
    GPTLAB_SLURM_NODES=1 bash tests/cluster/local_slurm.sh up
}

ci_down_slurm() {
    bash tests/cluster/local_slurm.sh down
}
