package qemu

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// CPUPlacement is how a node keeps its VMs below itself on the CPU: a CPU
// cgroup of lower weight than the agent's, or nice values where no such
// cgroup can be had. A cgroup weight does not slow a booting guest against
// other guests or other work the way a nice value in the agent's session
// does: with scheduler autogroups (kernel.sched_autogroup_enabled=1, for
// processes in the root CPU cgroup) a VM at nice 10 in the agent's session
// yields to every thread of that session (the agent; on a test host its
// API server and etcd) at 110 against 1024, and the whole session, VMs
// included, weighs what one other session does. A VM in a cgroup of its
// own is outside every autogroup (the kernel only applies them to the root
// task group): the VMs' parent weighs CPUWeight against the agent's
// session or cgroup (100), and the VMs share that equally.
type CPUPlacement struct {
	// Cgroup is the base of every VM's cgroup (Spec.Cgroup), nil: the
	// agent's own.
	Cgroup *Cgroup
	// Nice is every VM's Spec.Nice.
	Nice int
	// Why says how the VMs are placed and why, for the agent's log.
	Why string
}

// PlacementInput is what PlanCPUPlacement decides from.
type PlacementInput struct {
	// Base is the node's VM cgroup: its root and parent, and in mode Own
	// (Own true) every VM's cgroup.
	Base Cgroup
	Own  bool
	// Weight is the VMs' parent's CPU weight (1-10000; 0: no cgroup for
	// CPU, nice values only). Nice is the nice value of the fallback.
	Weight, Nice int
	// AgentCPUCgroup is the agent's cgroup in the CPU controller's
	// hierarchy ("/": the root, where autogroups apply; AgentCPUCgroupOf).
	// AgentErr is why it is not known.
	AgentCPUCgroup string
	AgentErr       error
}

// PlanCPUPlacement decides where the node's VMs run against the agent.
// Pure: the caller then prepares the cgroup's parent
// (PrepareCgroupParent) and falls back (CPUPlacement.Fallback) when it
// may not.
//
//   - Weight 0: nice values only (Base as in mode Own, nil otherwise).
//   - Mode Own: every VM in its own cgroup already; its parent gets the
//     weight and no nice value is needed.
//   - Mode Inherit with the agent in the root CPU cgroup: every VM in a
//     CPU-only cgroup under the parent (Cgroup.CPUOnly; in every other
//     hierarchy it stays in the agent's), the parent with the weight.
//   - Mode Inherit with the agent in a CPU cgroup of its own (a systemd
//     unit, a container): nice values, which there weigh each VM thread
//     against the agent's threads in that cgroup (no autogroups), and the
//     VMs stay in it.
func PlanCPUPlacement(in PlacementInput) CPUPlacement {
	nice := func(why string) CPUPlacement {
		p := CPUPlacement{Nice: in.Nice, Why: fmt.Sprintf("%s: VMs run at nice %d", why, in.Nice)}
		if in.Own {
			c := in.Base
			p.Cgroup = &c
		}
		return p
	}
	switch {
	case in.Weight == 0:
		return nice("no CPU weight configured (vmCgroup.cpuWeight 0)")
	case in.Own:
		c := in.Base
		c.ParentCPUWeight = in.Weight
		return CPUPlacement{Cgroup: &c, Why: fmt.Sprintf("every VM in a cgroup of its own under %s (CPU weight %d against the agent's 100)", c.Parent, in.Weight)}
	case in.AgentErr != nil:
		return nice(fmt.Sprintf("the agent's CPU cgroup is unknown (%v)", in.AgentErr))
	case in.AgentCPUCgroup != "/":
		return nice(fmt.Sprintf("the agent runs in CPU cgroup %s (no scheduler autogroups there; its VMs stay in it)", in.AgentCPUCgroup))
	}
	c := in.Base
	c.CPUOnly, c.ParentCPUWeight = true, in.Weight
	c.CPUMilli, c.MemoryMaxBytes = 0, 0
	return CPUPlacement{Cgroup: &c, Why: fmt.Sprintf("every VM in a CPU cgroup of its own under %s (CPU weight %d against the agent's session at 100)", c.Parent, in.Weight)}
}

// Fallback is the placement when the cgroup of p could not be prepared
// (err, from PrepareCgroupParent): nice values, with the VMs in the
// agent's cgroup unless mode Own puts them in their own (in: p's input).
func (p CPUPlacement) Fallback(in PlacementInput, err error) CPUPlacement {
	out := CPUPlacement{Nice: in.Nice, Why: fmt.Sprintf("no CPU cgroup for the VMs (%v): VMs run at nice %d", err, in.Nice)}
	if in.Own {
		c := in.Base
		out.Cgroup = &c
	}
	return out
}

// PlaceCPU carries PlanCPUPlacement out for this process as the agent:
// it reads the agent's CPU cgroup when the plan needs it (mode Inherit
// with a weight), prepares the VMs' parent cgroup, and falls back
// (Fallback) when it may not. The outcome says why in Why.
func PlaceCPU(in PlacementInput) CPUPlacement {
	if !in.Own && in.Weight > 0 && in.AgentCPUCgroup == "" && in.AgentErr == nil {
		in.AgentCPUCgroup, in.AgentErr = AgentCPUCgroupOf(in.Base.Root, os.Getpid())
	}
	p := PlanCPUPlacement(in)
	if p.Cgroup != nil && p.Cgroup.ParentCPUWeight > 0 {
		if err := PrepareCgroupParent(*p.Cgroup); err != nil {
			p = p.Fallback(in, err)
		}
	}
	return p
}

// AgentCPUCgroupOf is pid's cgroup in the hierarchy of the CPU controller
// under root: the cgroup2 hierarchy when root is a cgroup2 mount, the v1
// hierarchy holding cpu otherwise.
func AgentCPUCgroupOf(root string, pid int) (string, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(root, &st); err != nil {
		return "", fmt.Errorf("cgroup root %s: %w", root, err)
	}
	if st.Type == unix.CGROUP2_SUPER_MAGIC {
		return CgroupOf(pid, "")
	}
	return CgroupOf(pid, "cpu")
}
