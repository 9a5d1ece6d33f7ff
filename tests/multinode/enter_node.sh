#!/bin/sh
# Hydra's launcher for simulated nodes (tests/multinode/cluster.py). mpiexec calls it as it would call
# ssh, `enter_node.sh -x HOST COMMAND...`; instead of logging in to HOST it runs COMMAND in HOST's
# network namespace, in a UTS namespace of its own whose hostname is HOST (so MPI_Get_processor_name
# and MPICH's node detection see HOST). The COMMAND words are joined and given to sh, as ssh does.
while [ "${1#-}" != "$1" ]; do shift; done  # ssh's options (-x): nothing to do here
host=$1
shift
exec ip netns exec "${MINIPAR_NETNS_PREFIX:?set by cluster.py}$host" unshare --uts \
    sh -c "hostname $host && exec $*"
