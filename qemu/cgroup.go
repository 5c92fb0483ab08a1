package qemu

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Cgroup places a VM's QEMU in a cgroup of its own, <Root>/<Parent>/<name>
// where name is the state dir's base name, created through the cgroup
// filesystem (no systemd, no container runtime). A QEMU there is no longer
// in its launcher's cgroup, so whatever ends every process of the
// launcher's cgroup (a container runtime stopping a container, systemd
// stopping a unit) does not end the VM; Adopt finds it again. The VM's
// limits are set on its cgroup. The cgroup is removed when the VM's exit is
// recorded (by the VM's supervisor or a later Adopt).
//
// With cgroup v2 (Root is a cgroup2 mount) QEMU is forked into the cgroup
// (clone3 CLONE_INTO_CGROUP): it never runs in the launcher's cgroup. With
// cgroup v1 (Root holds one mount per hierarchy, as /sys/fs/cgroup in legacy
// and hybrid mode) the cgroup is made in every hierarchy and QEMU is moved
// there right after the fork, before Start connects to it.
type Cgroup struct {
	// Root is the cgroup filesystem's mount point (default /sys/fs/cgroup).
	Root string
	// Parent is the parent cgroup's path under Root, relative
	// ("qemu-kubelet", "machine/qemu-kubelet"); created when missing.
	Parent string
	// CPUMilli caps the VM's CPU time, in thousandths of a CPU (cpu.max;
	// cpu.cfs_quota_us under v1). 0: no cap.
	CPUMilli int64
	// MemoryMaxBytes caps the memory charged to the VM: guest RAM, QEMU's
	// own and the page cache of its disks (memory.max; memory.limit_in_bytes
	// under v1). The kernel's OOM killer ends QEMU past it. 0: no limit.
	MemoryMaxBytes int64
	// Namespace, when set, is a cgroup namespace file (/proc/1/ns/cgroup:
	// the host's, seen with the host's PID namespace) QEMU is forked in.
	// A caller in a cgroup namespace of its own (a container's, under
	// cgroup v2) may not place a process outside that namespace's root;
	// forking from the host's namespace may (needs CAP_SYS_ADMIN).
	Namespace string
	// CPUOnly places QEMU in its cgroup of the CPU controller's hierarchy
	// only (a cgroup v1 "cpu" hierarchy, or a cgroup2 root with the cpu
	// controller): in every other v1 hierarchy QEMU stays in its
	// launcher's cgroup, so what ends the launcher's cgroup still ends it.
	// For a launcher in the root CPU cgroup, where the CPU is shared by
	// sessions (scheduler autogroups) and nice values cannot put a VM
	// below its launcher (placement.go). No limits: MemoryMaxBytes must
	// be 0.
	CPUOnly bool
	// ParentCPUWeight is Parent's CPU weight on cgroup v2's scale (1 to
	// 10000, 100 being every cgroup's default; cpu.weight, v1's
	// cpu.shares as weight*1024/100): the share of the CPU all the VMs
	// under Parent get together against their siblings (the launcher's
	// cgroup or session) when both want it. Each VM's own cgroup keeps
	// the default, so VMs share it equally. 0 leaves Parent's weight as
	// it is.
	ParentCPUWeight int
}

// MaxCPUWeight is the largest cgroup v2 cpu.weight.
const MaxCPUWeight = 10000

// cpuShares is cgroup v1's cpu.shares for a cgroup v2 cpu.weight w (the
// kernel's own scale: weight 100 is 1024 shares), at least v1's minimum 2.
func cpuShares(w int) int {
	return max(w*1024/100, 2)
}

// DefaultCgroupRoot is where cgroupfs is mounted on Linux hosts.
const DefaultCgroupRoot = "/sys/fs/cgroup"

// cgroupMinHeadroom: a memory limit must leave QEMU this much beyond the
// guest's RAM.
const cgroupMinHeadroom = 32 << 20

var cgroupNameRE = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$`)

// cgroupReserved are prefixes of the interface files of a cgroup: a
// cgroup named like one would clash with them.
var cgroupReserved = []string{"cgroup.", "cpu.", "cpuacct.", "cpuset.", "memory.", "io.", "blkio.", "pids.", "hugetlb.", "rdma.", "misc.", "devices.", "freezer.", "net_cls.", "net_prio.", "perf_event.", "notify_on_release", "release_agent", "tasks"}

// ValidateCgroupName checks one path element of a cgroup path.
func ValidateCgroupName(n string) error {
	if !cgroupNameRE.MatchString(n) {
		return fmt.Errorf("%q: want 1-128 characters of [A-Za-z0-9._-] starting with a letter, digit or _", n)
	}
	for _, p := range cgroupReserved {
		if strings.HasPrefix(n, p) {
			return fmt.Errorf("%q: clashes with the cgroup interface files %s*", n, p)
		}
	}
	return nil
}

// ValidateCgroupParent checks a parent cgroup path (relative to the root).
func ValidateCgroupParent(p string) error {
	if p == "" {
		return errors.New("empty: name a cgroup under the root, e.g. qemu-kubelet")
	}
	if strings.HasPrefix(p, "/") || filepath.Clean(p) != p {
		return fmt.Errorf("%q: want a clean path relative to the cgroup root (no leading /, no . or ..)", p)
	}
	for _, e := range strings.Split(p, "/") {
		if err := ValidateCgroupName(e); err != nil {
			return fmt.Errorf("%q: element %w", p, err)
		}
	}
	return nil
}

func (c Cgroup) root() string {
	if c.Root == "" {
		return DefaultCgroupRoot
	}
	return c.Root
}

// validate checks c for the VM of spec s (name: the state dir's base name).
func (c Cgroup) validate(s Spec) []error {
	var errs []error
	bad := func(format string, a ...any) { errs = append(errs, fmt.Errorf("cgroup: "+format, a...)) }
	if !filepath.IsAbs(c.root()) {
		bad("root %q: must be an absolute path", c.Root)
	}
	if err := ValidateCgroupParent(c.Parent); err != nil {
		bad("parent %v", err)
	}
	if s.StateDir != "" {
		if err := ValidateCgroupName(filepath.Base(s.StateDir)); err != nil {
			bad("name (the state dir's base name) %v", err)
		}
	}
	if c.Namespace != "" && !filepath.IsAbs(c.Namespace) {
		bad("namespace %q: must be an absolute path", c.Namespace)
	}
	if c.CPUMilli < 0 || (c.CPUMilli > 0 && c.CPUMilli < 10) {
		bad("cpu %dm: must be 0 (no cap) or at least 10m", c.CPUMilli)
	}
	if c.ParentCPUWeight < 0 || c.ParentCPUWeight > MaxCPUWeight {
		bad("parent CPU weight %d: must be 0 (left as it is) or 1 to %d", c.ParentCPUWeight, MaxCPUWeight)
	}
	if c.CPUOnly && c.MemoryMaxBytes != 0 {
		bad("memory limit %d bytes: a CPU-only cgroup has no memory controller", c.MemoryMaxBytes)
	}
	if min := int64(s.MemoryMiB)<<20 + cgroupMinHeadroom; c.MemoryMaxBytes < 0 || (c.MemoryMaxBytes > 0 && c.MemoryMaxBytes < min) {
		bad("memory limit %d bytes: must be 0 (no limit) or at least the guest's %d MiB plus %d MiB for QEMU itself", c.MemoryMaxBytes, s.MemoryMiB, cgroupMinHeadroom>>20)
	}
	return errs
}

// cgroupDir is the VM's cgroup in one hierarchy.
type cgroupDir struct {
	path string
	v2   bool
	// controllers of a v1 hierarchy ("cpu", "memory", "cpuset", ...).
	controllers []string
}

func (d cgroupDir) has(ctrl string) bool {
	for _, c := range d.controllers {
		if c == ctrl {
			return true
		}
	}
	return false
}

// cgroupDirs lists the VM's cgroup in every hierarchy under root: one for a
// cgroup2 root, one per v1 hierarchy (and the hybrid mode's unified one)
// otherwise.
func cgroupDirs(root, rel string) ([]cgroupDir, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(root, &st); err != nil {
		return nil, fmt.Errorf("cgroup root %s: %w", root, err)
	}
	if st.Type == unix.CGROUP2_SUPER_MAGIC {
		return []cgroupDir{{path: filepath.Join(root, rel), v2: true}}, nil
	}
	ents, err := os.ReadDir(root)
	if err != nil {
		return nil, fmt.Errorf("cgroup root %s: %w", root, err)
	}
	var dirs []cgroupDir
	for _, e := range ents {
		if !e.IsDir() { // symlinks (cpu -> cpu,cpuacct) name a hierarchy listed anyway
			continue
		}
		h := filepath.Join(root, e.Name())
		if err := unix.Statfs(h, &st); err != nil {
			continue
		}
		switch st.Type {
		case unix.CGROUP2_SUPER_MAGIC:
			dirs = append(dirs, cgroupDir{path: filepath.Join(h, rel), v2: true})
		case unix.CGROUP_SUPER_MAGIC:
			dirs = append(dirs, cgroupDir{path: filepath.Join(h, rel), controllers: strings.Split(e.Name(), ",")})
		}
	}
	if len(dirs) == 0 {
		return nil, fmt.Errorf("cgroup root %s: neither a cgroup2 mount nor a directory of cgroup v1 mounts", root)
	}
	return dirs, nil
}

// vmCgroupDirs: the VM's cgroup in every hierarchy it is placed in.
func (s Spec) vmCgroupDirs() ([]cgroupDir, error) {
	return s.Cgroup.dirs(filepath.Join(s.Cgroup.Parent, filepath.Base(s.StateDir)))
}

// dirs lists the cgroup rel (relative to the root) in every hierarchy c
// places QEMU in: all of them, or with CPUOnly the one holding the cpu
// controller.
func (c Cgroup) dirs(rel string) ([]cgroupDir, error) {
	dirs, err := cgroupDirs(c.root(), rel)
	if err != nil || !c.CPUOnly {
		return dirs, err
	}
	if len(dirs) == 1 && dirs[0].v2 {
		return dirs, nil // a cgroup2 root: one hierarchy, cpu among its controllers
	}
	for _, d := range dirs {
		if !d.v2 && d.has("cpu") {
			return []cgroupDir{d}, nil
		}
	}
	return nil, fmt.Errorf("cgroup root %s: no hierarchy with the cpu controller", c.root())
}

// prepareCgroup creates the VM's cgroup (and its parents) in every
// hierarchy and sets its limits. A cgroup left by an earlier run of the
// same VM is reused.
func prepareCgroup(s Spec) ([]cgroupDir, error) {
	c := *s.Cgroup
	dirs, err := s.vmCgroupDirs()
	if err != nil {
		return nil, err
	}
	for _, d := range dirs {
		hier := strings.TrimSuffix(d.path, "/"+filepath.Join(c.Parent, filepath.Base(s.StateDir)))
		if d.v2 {
			// In hybrid mode the unified hierarchy carries no controllers
			// (the v1 ones do): only a cgroup2 root must have them.
			if err := prepareV2(hier, d.path, c, len(dirs) == 1); err != nil {
				return nil, err
			}
			continue
		}
		if err := prepareV1(hier, d, c); err != nil {
			return nil, err
		}
	}
	if err := setParentWeight(dirs, c); err != nil {
		return nil, err
	}
	return dirs, nil
}

// PrepareCgroupParent creates c's Parent in every hierarchy c places VMs
// in and sets its CPU weight (ParentCPUWeight): what every VM's start
// does first, done once ahead to learn whether this process may (an agent
// deciding between a CPU cgroup and nice values: placement.go).
func PrepareCgroupParent(c Cgroup) error {
	if err := ValidateCgroupParent(c.Parent); err != nil {
		return fmt.Errorf("cgroup: parent %w", err)
	}
	if c.ParentCPUWeight < 0 || c.ParentCPUWeight > MaxCPUWeight {
		return fmt.Errorf("cgroup: parent CPU weight %d: must be 0 to %d", c.ParentCPUWeight, MaxCPUWeight)
	}
	dirs, err := c.dirs(c.Parent)
	if err != nil {
		return err
	}
	for _, d := range dirs {
		hier := strings.TrimSuffix(d.path, "/"+c.Parent)
		if d.v2 {
			need := []string(nil)
			if c.ParentCPUWeight > 0 {
				need = []string{"cpu"}
			}
			if err := makeV2Path(hier, d.path, need, len(dirs) == 1); err != nil {
				return err
			}
			continue
		}
		if err := makeV1Path(hier, d); err != nil {
			return err
		}
	}
	// The weight is set on the parent; dirs are the parent's own here.
	return setWeight(dirs, c.ParentCPUWeight)
}

// setParentWeight sets the CPU weight of the parent of the VM's cgroup
// dirs (c.ParentCPUWeight; nothing when 0).
func setParentWeight(dirs []cgroupDir, c Cgroup) error {
	parents := make([]cgroupDir, len(dirs))
	for i, d := range dirs {
		parents[i] = d
		parents[i].path = filepath.Dir(d.path)
	}
	return setWeight(parents, c.ParentCPUWeight)
}

// setWeight writes CPU weight w to each dir: cpu.weight in a cgroup2
// hierarchy that offers it, cpu.shares in a v1 hierarchy with the cpu
// controller. A cgroup2 hierarchy without it (the hybrid layout's, whose
// controllers are v1's) is left alone.
func setWeight(dirs []cgroupDir, w int) error {
	if w == 0 {
		return nil
	}
	set := false
	for _, d := range dirs {
		switch {
		case d.v2 && fileExists(filepath.Join(d.path, "cpu.weight")):
			if err := writeCgroupFile(d.path, "cpu.weight", strconv.Itoa(w)); err != nil {
				return err
			}
			set = true
		case !d.v2 && d.has("cpu"):
			if err := writeCgroupFile(d.path, "cpu.shares", strconv.Itoa(cpuShares(w))); err != nil {
				return err
			}
			set = true
		}
	}
	if !set {
		return fmt.Errorf("cgroup: CPU weight %d: no hierarchy with the cpu controller under %v", w, dirs)
	}
	return nil
}

func writeCgroupFile(dir, name, val string) error {
	if err := os.WriteFile(filepath.Join(dir, name), []byte(val), 0); err != nil {
		return fmt.Errorf("cgroup: write %q to %s: %w", val, filepath.Join(dir, name), err)
	}
	return nil
}

// prepareV2 makes hier/.../vm, enabling on the way down the controllers its
// limits need (cgroup v2 hands a controller to a child only when the
// parent's cgroup.subtree_control lists it); a controller the hierarchy
// lacks is an error when strict, else skipped.
func prepareV2(hier, vm string, c Cgroup, strict bool) error {
	var need []string
	if c.CPUMilli > 0 || c.ParentCPUWeight > 0 {
		need = append(need, "cpu")
	}
	if c.MemoryMaxBytes > 0 {
		need = append(need, "memory")
	}
	if err := makeV2Path(hier, vm, need, strict); err != nil {
		return err
	}
	return setV2Limits(vm, c)
}

// makeV2Path makes hier/.../path, enabling on the way down the
// controllers need (see prepareV2).
func makeV2Path(hier, path string, need []string, strict bool) error {
	rel, _ := filepath.Rel(hier, path)
	cur := hier
	for _, e := range strings.Split(rel, "/") {
		if len(need) > 0 {
			avail, err := os.ReadFile(filepath.Join(cur, "cgroup.controllers"))
			if err != nil {
				return fmt.Errorf("cgroup: %w", err)
			}
			enabled, _ := os.ReadFile(filepath.Join(cur, "cgroup.subtree_control"))
			for _, n := range need {
				if !fieldsContain(string(avail), n) {
					if !strict {
						continue
					}
					return fmt.Errorf("cgroup: controller %s not available in %s (cgroup.controllers: %q)", n, cur, strings.TrimSpace(string(avail)))
				}
				if !fieldsContain(string(enabled), n) {
					if err := writeCgroupFile(cur, "cgroup.subtree_control", "+"+n); err != nil {
						return err
					}
				}
			}
		}
		cur = filepath.Join(cur, e)
		if err := os.Mkdir(cur, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("cgroup: create %s: %w", cur, err)
		}
	}
	return nil
}

// setV2Limits writes c's limits to the VM's cgroup2 dir vm.
func setV2Limits(vm string, c Cgroup) error {
	cpu, mem := "max 100000", "max"
	if c.CPUMilli > 0 {
		cpu = fmt.Sprintf("%d 100000", c.CPUMilli*100)
	}
	if c.MemoryMaxBytes > 0 {
		mem = strconv.FormatInt(c.MemoryMaxBytes, 10)
	}
	if fileExists(filepath.Join(vm, "cpu.max")) {
		if err := writeCgroupFile(vm, "cpu.max", cpu); err != nil {
			return err
		}
	}
	if fileExists(filepath.Join(vm, "memory.max")) {
		if err := writeCgroupFile(vm, "memory.max", mem); err != nil {
			return err
		}
	}
	return nil
}

// prepareV1 makes the VM's cgroup in one v1 hierarchy. A new cpuset cgroup
// has no CPUs and memory nodes (no process may join it): they are copied
// from its parent.
func prepareV1(hier string, d cgroupDir, c Cgroup) error {
	if err := makeV1Path(hier, d); err != nil {
		return err
	}
	return setV1Limits(d, c)
}

// makeV1Path makes hier/.../d.path in one v1 hierarchy (see prepareV1).
func makeV1Path(hier string, d cgroupDir) error {
	rel, _ := filepath.Rel(hier, d.path)
	cur := hier
	for _, e := range strings.Split(rel, "/") {
		parent := cur
		cur = filepath.Join(cur, e)
		if err := os.Mkdir(cur, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("cgroup: create %s: %w", cur, err)
		}
		if d.has("cpuset") {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				if b, _ := os.ReadFile(filepath.Join(cur, f)); strings.TrimSpace(string(b)) != "" {
					continue
				}
				b, err := os.ReadFile(filepath.Join(parent, f))
				if err != nil {
					return fmt.Errorf("cgroup: %w", err)
				}
				if err := writeCgroupFile(cur, f, strings.TrimSpace(string(b))); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// setV1Limits writes c's limits to the VM's cgroup d of one v1 hierarchy.
func setV1Limits(d cgroupDir, c Cgroup) error {
	if d.has("cpu") {
		quota := "-1"
		if c.CPUMilli > 0 {
			quota = strconv.FormatInt(c.CPUMilli*100, 10)
		}
		if err := writeCgroupFile(d.path, "cpu.cfs_period_us", "100000"); err != nil {
			return err
		}
		if err := writeCgroupFile(d.path, "cpu.cfs_quota_us", quota); err != nil {
			return err
		}
	}
	if d.has("memory") {
		mem := "-1"
		if c.MemoryMaxBytes > 0 {
			mem = strconv.FormatInt(c.MemoryMaxBytes, 10)
		}
		if err := writeCgroupFile(d.path, "memory.limit_in_bytes", mem); err != nil {
			return err
		}
	}
	return nil
}

// openCgroupV2 opens the VM's cgroup2 directory for CLONE_INTO_CGROUP when
// the root is a cgroup2 mount (-1 otherwise: the process is moved after the
// fork).
func openCgroupV2(dirs []cgroupDir) (int, error) {
	if len(dirs) != 1 || !dirs[0].v2 {
		return -1, nil
	}
	fd, err := unix.Open(dirs[0].path, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("cgroup: open %s: %w", dirs[0].path, err)
	}
	return fd, nil
}

// moveToCgroup puts pid (all its threads) in the VM's cgroup of every
// hierarchy.
func moveToCgroup(dirs []cgroupDir, pid int) error {
	for _, d := range dirs {
		if err := writeCgroupFile(d.path, "cgroup.procs", strconv.Itoa(pid)); err != nil {
			return err
		}
	}
	return nil
}

// removeCgroup removes the VM's cgroup from every hierarchy once its
// processes are gone (an exiting QEMU may still be listed for a moment).
func removeCgroup(s Spec) error {
	if s.Cgroup == nil {
		return nil
	}
	dirs, err := s.vmCgroupDirs()
	if err != nil {
		return err
	}
	var errs []error
	for _, d := range dirs {
		deadline := time.Now().Add(2 * time.Second)
		for {
			err := syscall.Rmdir(d.path)
			if err == nil || errors.Is(err, syscall.ENOENT) {
				break
			}
			if !errors.Is(err, syscall.EBUSY) || time.Now().After(deadline) {
				errs = append(errs, fmt.Errorf("cgroup: remove %s: %w", d.path, err))
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return errors.Join(errs...)
}

// CgroupOf returns pid's cgroup path in the hierarchy that holds the
// controller ctrl ("" for cgroup v2's unified hierarchy), as
// /proc/<pid>/cgroup names it.
func CgroupOf(pid int, ctrl string) (string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return "", err
	}
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.SplitN(l, ":", 3)
		if len(f) != 3 {
			continue
		}
		if (ctrl == "" && f[1] == "") || (ctrl != "" && fieldsContain(strings.ReplaceAll(f[1], ",", " "), ctrl)) {
			return f[2], nil
		}
	}
	return "", fmt.Errorf("/proc/%d/cgroup: no hierarchy with %q", pid, ctrl)
}

func fieldsContain(s, w string) bool {
	for _, f := range strings.Fields(s) {
		if f == w {
			return true
		}
	}
	return false
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
