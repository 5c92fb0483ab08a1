package config

import (
	"fmt"
	"path/filepath"
	"regexp"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation/field"
)

// VM cgroup modes (vmCgroup.mode).
const (
	// VMCgroupInherit: QEMU runs in the agent's cgroup (a systemd unit with
	// KillMode=process keeps VMs across restarts: docs/off-cluster.md),
	// but for the CPU controller's hierarchy when the agent runs in the
	// root CPU cgroup and cpuWeight is set (qemu.PlanCPUPlacement).
	VMCgroupInherit = "Inherit"
	// VMCgroupOwn: each QEMU runs in a cgroup of its own,
	// <root>/<parent>/<pod UID>, outside the agent's cgroup, so whatever
	// stops every process of the agent's cgroup (a container runtime
	// stopping the agent's container) leaves the VMs running for the next
	// agent to adopt. The pod's CPU limit and its guest memory plus
	// vmMemory.overhead are the cgroup's limits.
	VMCgroupOwn = "Own"
)

// Defaults of vmCgroup.
const (
	DefaultVMCgroupMode   = VMCgroupInherit
	DefaultVMCgroupRoot   = "/sys/fs/cgroup"
	DefaultVMCgroupParent = "qemu-kubelet"
	// DefaultVMCPUWeight: the VMs together weigh what the agent's cgroup
	// or session weighs (cgroup v2's default, 100), each VM a share of
	// that. A lower weight also puts the VMs below every other session or
	// cgroup of the host, which slows a booting guest on a shared host
	// (bench/history.md, issue #42).
	DefaultVMCPUWeight = 100
	// MaxVMCPUWeight is cgroup v2's largest cpu.weight.
	MaxVMCPUWeight = 10000
)

// VMCgroup says in which cgroup each VM's QEMU runs.
type VMCgroup struct {
	// Mode is Inherit (default: the agent's cgroup) or Own (a cgroup per
	// VM under root/parent, made through the cgroup filesystem).
	Mode string `json:"mode,omitempty"`
	// Root is the cgroup filesystem's mount point as the agent sees it
	// (default /sys/fs/cgroup; in a container, the host's, mounted there).
	Root string `json:"root,omitempty"`
	// Parent is the parent of the VMs' cgroups, relative to root (default
	// qemu-kubelet); created when missing.
	Parent string `json:"parent,omitempty"`
	// Namespace is a cgroup namespace file QEMU is started in (empty: the
	// agent's). An agent in a container with a cgroup namespace of its own
	// (cgroup v2) may only place processes inside that namespace; with the
	// host's PID namespace, /proc/1/ns/cgroup is the host's. Joining it
	// needs CAP_SYS_ADMIN.
	Namespace string `json:"namespace,omitempty"`
	// CPUWeight is the CPU weight of parent, the cgroup of all the VMs,
	// on cgroup v2's scale (1-10000; every cgroup and session weighs 100;
	// default 100): when the agent and the VMs both want the CPU, the VMs
	// together get CPUWeight/(100+CPUWeight) of it, and each VM as much
	// as any other. In mode Inherit each VM gets a cgroup of its own in
	// the CPU controller's hierarchy only, when the agent runs in the root
	// CPU cgroup (docs/node-config.md). Where no cgroup can be had, and
	// with 0, vmNice keeps the VMs below the agent instead.
	CPUWeight *int32 `json:"cpuWeight,omitempty"`
}

// VMCgroupConfig is the resolved vmCgroup section.
type VMCgroupConfig struct {
	// Own: every VM in a cgroup of its own under Root/Parent.
	Own                     bool
	Root, Parent, Namespace string
	// CPUWeight: the VMs' parent's CPU weight (0: nice values only).
	CPUWeight int
}

func defaultVMCgroup(c *VMCgroup) {
	if c.Mode == "" {
		c.Mode = DefaultVMCgroupMode
	}
	if c.Root == "" {
		c.Root = DefaultVMCgroupRoot
	}
	if c.Parent == "" {
		c.Parent = DefaultVMCgroupParent
	}
	defaultInt32(&c.CPUWeight, DefaultVMCPUWeight)
}

var cgroupElemRE = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$`)

// cgroupInterfacePrefixes: a cgroup named like an interface file clashes
// with it.
var cgroupInterfacePrefixes = []string{"cgroup.", "cpu.", "cpuacct.", "cpuset.", "memory.", "io.", "blkio.", "pids.", "hugetlb.", "rdma.", "misc.", "devices.", "freezer.", "net_cls.", "net_prio.", "perf_event.", "notify_on_release", "release_agent", "tasks"}

func validateVMCgroup(c VMCgroup, errs field.ErrorList) (VMCgroupConfig, field.ErrorList) {
	p := field.NewPath("vmCgroup")
	out := VMCgroupConfig{Root: c.Root, Parent: c.Parent, Namespace: c.Namespace}
	switch c.Mode {
	case VMCgroupInherit:
	case VMCgroupOwn:
		out.Own = true
	default:
		errs = append(errs, field.NotSupported(p.Child("mode"), c.Mode, []string{VMCgroupInherit, VMCgroupOwn}))
	}
	if !filepath.IsAbs(c.Root) || filepath.Clean(c.Root) != c.Root {
		errs = append(errs, field.Invalid(p.Child("root"), c.Root, "must be a clean absolute path (where the cgroup filesystem is mounted)"))
	}
	if c.Namespace != "" && (!filepath.IsAbs(c.Namespace) || filepath.Clean(c.Namespace) != c.Namespace) {
		errs = append(errs, field.Invalid(p.Child("namespace"), c.Namespace, "must be a clean absolute path (a cgroup namespace file such as /proc/1/ns/cgroup)"))
	}
	if msg := badCgroupParent(c.Parent); msg != "" {
		errs = append(errs, field.Invalid(p.Child("parent"), c.Parent, msg))
	}
	if w := *c.CPUWeight; w < 0 || w > MaxVMCPUWeight {
		errs = append(errs, field.Invalid(p.Child("cpuWeight"), w, fmt.Sprintf("must be 0 (no CPU cgroup: vmNice only) or 1 to %d (cgroup v2's cpu.weight scale)", MaxVMCPUWeight)))
	} else {
		out.CPUWeight = int(w)
	}
	return out, errs
}

// badCgroupParent says what is wrong with a parent cgroup path ("" if
// nothing).
func badCgroupParent(s string) string {
	if strings.HasPrefix(s, "/") || filepath.Clean(s) != s || s == "." || s == ".." || strings.HasPrefix(s, "../") {
		return "must be a clean path relative to the cgroup root (no leading /, no . or ..)"
	}
	for _, e := range strings.Split(s, "/") {
		if !cgroupElemRE.MatchString(e) {
			return fmt.Sprintf("element %q: want 1-128 characters of [A-Za-z0-9._-] starting with a letter, digit or _", e)
		}
		for _, pre := range cgroupInterfacePrefixes {
			if strings.HasPrefix(e, pre) {
				return fmt.Sprintf("element %q clashes with the cgroup interface files %s*", e, pre)
			}
		}
	}
	return ""
}
