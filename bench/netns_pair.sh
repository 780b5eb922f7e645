# Sourced by the multi-host benchmarks: two "hosts" as network namespaces
# joined by one veth pair whose both ends are shaped to 1 Gbit/s. Needs root.
#
#   source bench/netns_pair.sh
#   netns_pair_up NAME SUBNET SHAPE   # e.g. cohort_bench 10.78.0 netem
#
# Sets ns=(ns0 ns1) and veth=(dev0 dev1) (names end in the shell's pid, so
# runs do not collide); host i has address SUBNET.(i+1). SHAPE netem adds
# 0.5 ms delay where the kernel has netem and falls back to tbf (saying so);
# SHAPE tbf shapes with tbf alone. The namespaces are deleted on exit.
netns_pair_down() { for n in "${ns[@]}"; do ip netns delete "$n" 2>/dev/null || true; done; }

netns_pair_up() {
  local name=$1 subnet=$2 shape=$3 i
  ns=("${name}_a$$" "${name}_b$$")
  # Interface names are limited to 15 characters.
  veth=("${name:0:4}va$$" "${name:0:4}vb$$")
  trap netns_pair_down EXIT
  for i in 0 1; do ip netns add "${ns[$i]}"; done
  ip link add "${veth[0]}" type veth peer name "${veth[1]}"
  for i in 0 1; do
    ip link set "${veth[$i]}" netns "${ns[$i]}"
    ip -n "${ns[$i]}" addr add "$subnet.$((i + 1))/24" dev "${veth[$i]}"
    ip -n "${ns[$i]}" link set "${veth[$i]}" up
    ip -n "${ns[$i]}" link set lo up
    if [ "$shape" = netem ] && ip netns exec "${ns[$i]}" tc qdisc add dev "${veth[$i]}" root \
      netem rate 1gbit delay 0.5ms 2>/dev/null; then
      continue
    fi
    ip netns exec "${ns[$i]}" tc qdisc add dev "${veth[$i]}" root tbf rate 1gbit burst 128kb latency 50ms
    if [ "$shape" = netem ] && [ "$i" = 0 ]; then echo "# netem unavailable: tbf 1 Gbit/s, no added delay"; fi
  done
}
