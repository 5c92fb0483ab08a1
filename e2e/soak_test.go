package e2e

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/controller"
	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/qemu-kubelet/qemu-kubelet/internal/exs"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
)

// The soak's grace windows. The machine it runs on is shared and loaded
// (load average 20+ on 2 cores, VMs under TCG), so they are generous: a
// window measures how long the product may take to repair what a fault
// broke, and only a state that outlasts it is a violation.
const (
	// soakOrphanGrace: a QEMU whose pod has left the API server must be
	// gone within this long (pods have a 10 s grace period; the agent
	// stops the VM, then deletes the pod object). The clock starts when
	// the QEMU is first seen orphaned or when the agent (re)started,
	// whichever is later: a dead agent cannot stop anything.
	soakOrphanGrace = 120 * time.Second
	// soakReadyGrace: a pod may show Ready without a QEMU for this long
	// after a kill -9 (the agent sees the exit, marks the pod not ready and
	// restarts the VM; its status push can lag on a loaded machine). Same
	// clock rule as above.
	soakReadyGrace = 60 * time.Second
	// soakSettle: after the chaos stops (everything back up, the soak's
	// leases kept), how long the sets, VMs and state dirs have to converge.
	soakSettle = 8 * time.Minute
	// soakCheckEvery: the period of the continuous checks.
	soakCheckEvery = 4 * time.Second
)

// TestSoak is the chaos soak (make soak; docs/operations.md "Chaos soak"):
// a real control plane, one qemu-kubelet node and the exporterset-controller
// as processes, two small ExporterSets; for SOAK_DURATION it injects random
// faults from a seeded RNG (SOAK_SEED replays the sequence of choices; the
// outcomes still depend on timing) and checks the invariants every few
// seconds, then once more after a settle period. It reports the events by
// kind and every violation, and fails if there was one.
func TestSoak(t *testing.T) {
	durEnv := os.Getenv("SOAK_DURATION")
	if durEnv == "" {
		t.Skip("the chaos soak runs only when SOAK_DURATION is set (make soak SOAK_DURATION=30m)")
	}
	testutil.SkipIfShort(t, "QEMU VMs, a registry and a control plane")
	dur, err := time.ParseDuration(durEnv)
	if err != nil || dur <= 0 {
		t.Fatalf("SOAK_DURATION=%q: want a positive Go duration such as 30m", durEnv)
	}
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("SOAK_SEED"); v != "" {
		if seed, err = strconv.ParseUint(v, 10, 64); err != nil {
			t.Fatalf("SOAK_SEED=%q: want an unsigned integer", v)
		}
	}
	t.Logf("soak: duration %s, seed %d (SOAK_SEED=%d replays the choices)", dur, seed, seed)

	s := startSoak(t, seed)
	start := time.Now()
	s.log("chaos starts: load %s", loadAvg())
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); s.checkLoop(ctx) }()
	s.chaos(time.Now().Add(dur))
	s.log("chaos ends after %s: restoring agent, controller and registry; load %s", time.Since(start).Round(time.Second), loadAvg())
	s.restoreAll()
	s.settle()
	stop()
	wg.Wait()
	s.checkAgentLog()
	s.report(t, time.Since(start))
}

// soak is the soak's world. The chaos goroutine (the test's) owns rng,
// held, the processes and the proxy's switch; mu guards what the checker
// and the pod watch read of them and what they write (violations).
type soak struct {
	t        *testing.T
	e        *exsEnv
	rng      *rand.Rand
	agent    *soakProc
	ctrl     *soakProc
	proxy    *outageProxy
	exs      *exs.Client
	sets     []soakSet
	stateDir string

	mu          sync.Mutex
	agentUp     time.Time            // when the agent last started; zero while it is down
	soakDeleted map[types.UID]bool   // pods the soak itself deleted
	held        map[string]soakLease // pod name -> the soak's lease on it
	events      map[string]int
	violations  []soakViolation
	seen        map[string]bool          // violation keys already reported
	since       map[string]time.Time     // first time a suspect state was seen, by key
	longest     map[string]time.Duration // longest suspect state that was repaired, by kind
}

type soakSet struct {
	name          string
	min, max      int32 // spec.replicas range of scale events
	minAvail, cap int32 // spec.minAvailable, spec.maxReplicas
}

type soakLease struct {
	set, holder string
	uid         types.UID
}

type soakViolation struct {
	at     time.Time
	kind   string
	detail string
}

func startSoak(t *testing.T, seed uint64) *soak {
	root := ocitest.RepoRoot(t)
	tmp := t.TempDir()
	logDir := os.Getenv("SOAK_LOG_DIR")
	if logDir == "" {
		logDir = tmp
	} else if err := os.MkdirAll(logDir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Logf("soak: agent and controller logs in %s", logDir)
	kubeletBin := goBuild(t, root, tmp, kubeletPkg)
	ctrlBin := goBuild(t, root, tmp, ctrlPkg)

	c := cluster.StartT(t, cluster.Options{})
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	refs := vmtest.PushTestImages(t, reg.Addr)
	// Pods pull through a proxy the soak can take down: a registry outage.
	proxy := startOutageProxy(t, reg.Addr)
	image := strings.Replace(refs[vmtest.VariantACPI], reg.Addr, proxy.addr, 1)

	cl := exsClient(t, c)
	e := &exsEnv{c: c, cl: cl, node: "qk-soak", image: image, reg: proxy.addr, ns: "default"}
	e.installCRD(t)

	cfgPath, kc, state := writeVMNodeConfig(t, c, e.node, tmp)
	e.stateDir = state
	vmtest.ReapQEMU(t, state)
	s := &soak{t: t, e: e, rng: rand.New(rand.NewPCG(seed, seed^0x5eed)), proxy: proxy,
		exs: &exs.Client{C: cl, Namespace: e.ns}, stateDir: state,
		soakDeleted: map[types.UID]bool{}, held: map[string]soakLease{}, events: map[string]int{},
		seen: map[string]bool{}, since: map[string]time.Time{}, longest: map[string]time.Duration{}}
	s.agent = &soakProc{name: "qemu-kubelet", bin: kubeletBin, log: filepath.Join(logDir, "qemu-kubelet.log"),
		args: []string{"--config", cfgPath, "--kubeconfig", kc, "-v", "2"}}
	s.ctrl = &soakProc{name: "exporterset-controller", bin: ctrlBin, log: filepath.Join(logDir, "exporterset-controller.log"),
		args: []string{"--kubeconfig", c.AdminKubeconfig(),
			"--metrics-bind-address", fmt.Sprintf("127.0.0.1:%d", testutil.FreePort(t)),
			"--health-probe-bind-address", fmt.Sprintf("127.0.0.1:%d", testutil.FreePort(t)), "-v", "2"}}
	s.startAgent()
	t.Cleanup(s.agent.stop)
	s.ctrl.start(t)
	t.Cleanup(s.ctrl.stop)
	// Runs first: sets and pods go, their VMs stop, while agent and
	// controller still run.
	t.Cleanup(func() { e.deleteAll(t) })
	t.Cleanup(func() {
		if t.Failed() {
			for _, p := range []*soakProc{s.agent, s.ctrl} {
				b, _ := os.ReadFile(p.log)
				t.Logf("%s log (tail):\n%s", p.name, tail(string(b), 80))
			}
		}
	})
	e.waitNodeReady(t, 3*time.Minute)

	// Two small sets: A with a warm buffer of one, B whose pods pull
	// Always (each new pod asks the registry, so an outage shows).
	s.sets = []soakSet{
		{name: "soak-a", min: 1, max: 3, minAvail: 1, cap: 4},
		{name: "soak-b", min: 0, max: 2, minAvail: 1, cap: 2},
	}
	for _, ss := range s.sets {
		set := e.newSet(ss.name, image, ss.min+1, ss.minAvail)
		set.Spec.MaxReplicas = ptr.To(ss.cap)
		if ss.name == "soak-b" {
			set.Spec.Template.Spec.Containers[0].ImagePullPolicy = corev1.PullAlways
		}
		if err := cl.Create(context.Background(), set); err != nil {
			t.Fatalf("create exporterset %s: %v", ss.name, err)
		}
	}
	// Start from a converged state: every pod booted and Ready.
	for _, ss := range s.sets {
		want := controller.Target(ss.min+1, ss.minAvail, 0, 0, ptr.To(ss.cap))
		e.waitCounts(t, ss.name, counts{want, want, want, want, 0}, 6*time.Minute)
	}
	s.watchPods()
	return s
}

func (s *soak) log(format string, args ...any) {
	s.t.Logf("%s "+format, append([]any{time.Now().UTC().Format("15:04:05")}, args...)...)
}

func (s *soak) count(kind string) {
	s.mu.Lock()
	s.events[kind]++
	s.mu.Unlock()
}

// violate records a violation once per key.
func (s *soak) violate(key, kind, format string, args ...any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.seen[key] {
		return
	}
	s.seen[key] = true
	v := soakViolation{at: time.Now(), kind: kind, detail: fmt.Sprintf(format, args...)}
	s.violations = append(s.violations, v)
	s.t.Logf("%s VIOLATION %s: %s", v.at.UTC().Format("15:04:05"), kind, v.detail)
}

func (s *soak) startAgent() {
	s.agent.start(s.t)
	s.mu.Lock()
	s.agentUp = time.Now()
	s.mu.Unlock()
}

// chaos injects one random event every 2-8 s until end; a killed agent or
// controller comes back, and a registry outage ends, after a random delay
// while other events go on.
func (s *soak) chaos(end time.Time) {
	type kind struct {
		name   string
		weight int
		do     func()
	}
	var agentBack, ctrlBack, registryBack time.Time
	kinds := []kind{
		{"lease", 4, s.lease},
		{"release", 4, s.release},
		{"scale", 3, s.scale},
		{"delete-pod", 2, s.deletePod},
		{"kill-qemu", 3, s.killQEMU},
		{"kill-agent", 1, func() {
			if !agentBack.IsZero() {
				s.count("kill-agent-skipped")
				return
			}
			s.agent.kill9()
			s.mu.Lock()
			s.agentUp = time.Time{}
			s.mu.Unlock()
			d := time.Duration(2+s.rng.IntN(14)) * time.Second
			agentBack = time.Now().Add(d)
			s.log("kill -9 qemu-kubelet; restart in %s", d)
			s.count("kill-agent")
		}},
		{"restart-controller", 1, func() {
			if !ctrlBack.IsZero() {
				s.count("restart-controller-skipped")
				return
			}
			s.ctrl.kill9()
			d := time.Duration(1+s.rng.IntN(10)) * time.Second
			ctrlBack = time.Now().Add(d)
			s.log("kill -9 exporterset-controller; restart in %s", d)
			s.count("restart-controller")
		}},
		{"registry-outage", 1, func() {
			if !registryBack.IsZero() {
				s.count("registry-outage-skipped")
				return
			}
			s.proxy.setDown(true)
			d := time.Duration(10+s.rng.IntN(50)) * time.Second
			registryBack = time.Now().Add(d)
			s.log("registry down for %s", d)
			s.count("registry-outage")
		}},
	}
	total := 0
	for _, k := range kinds {
		total += k.weight
	}
	for time.Now().Before(end) {
		now := time.Now()
		if !agentBack.IsZero() && now.After(agentBack) {
			s.startAgent()
			agentBack = time.Time{}
			s.log("qemu-kubelet restarted")
		}
		if !ctrlBack.IsZero() && now.After(ctrlBack) {
			s.ctrl.start(s.t)
			ctrlBack = time.Time{}
			s.log("exporterset-controller restarted")
		}
		if !registryBack.IsZero() && now.After(registryBack) {
			s.proxy.setDown(false)
			registryBack = time.Time{}
			s.log("registry back")
		}
		n := s.rng.IntN(total)
		for _, k := range kinds {
			if n < k.weight {
				k.do()
				break
			}
			n -= k.weight
		}
		time.Sleep(time.Duration(2000+s.rng.IntN(6000)) * time.Millisecond)
	}
}

// restoreAll brings back whatever the chaos left down.
func (s *soak) restoreAll() {
	if !s.agent.running() {
		s.startAgent()
	}
	if !s.ctrl.running() {
		s.ctrl.start(s.t)
	}
	s.proxy.setDown(false)
}

func (s *soak) pick(sets ...string) string { return sets[s.rng.IntN(len(sets))] }

func (s *soak) setNames() []string {
	var out []string
	for _, ss := range s.sets {
		out = append(out, ss.name)
	}
	return out
}

// lease claims a free pod of a random set the way kubectl exs lease does
// (internal/exs: label claim with the resourceVersion as precondition).
func (s *soak) lease() {
	set := s.pick(s.setNames()...)
	holder := fmt.Sprintf("soak-%d", s.rng.IntN(1000))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p, _, err := s.exs.Lease(ctx, set, exs.LeaseOptions{Holder: holder})
	if err != nil {
		s.log("lease %s: %v", set, err)
		s.count("lease-none-free")
		return
	}
	s.mu.Lock()
	s.held[p.Name] = soakLease{set: set, holder: holder, uid: p.UID}
	s.mu.Unlock()
	s.log("leased %s of %s for %s", p.Name, set, holder)
	s.count("lease")
}

// release ends one of the soak's leases, chosen at random.
func (s *soak) release() {
	s.mu.Lock()
	names := make([]string, 0, len(s.held))
	for n := range s.held {
		names = append(names, n)
	}
	s.mu.Unlock()
	if len(names) == 0 {
		s.count("release-none-held")
		return
	}
	slices.Sort(names) // map order is random; the seed decides
	name := s.pick(names...)
	s.mu.Lock()
	l := s.held[name]
	delete(s.held, name) // released or gone: the soak no longer holds it
	s.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, _, _, err := s.exs.Release(ctx, name, exs.ReleaseOptions{Holder: l.holder}); err != nil {
		s.log("release %s: %v", name, err)
		s.count("release-failed")
		return
	}
	s.log("released %s", name)
	s.count("release")
}

// scale sets a random set's spec.replicas within its range.
func (s *soak) scale() {
	ss := s.sets[s.rng.IntN(len(s.sets))]
	n := ss.min + int32(s.rng.IntN(int(ss.max-ss.min+1)))
	patch := fmt.Sprintf(`{"spec":{"replicas":%d}}`, n)
	set := &v1alpha1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Name: ss.name, Namespace: s.e.ns}}
	if err := s.e.cl.Patch(context.Background(), set, client.RawPatch(types.MergePatchType, []byte(patch))); err != nil {
		s.log("scale %s: %v", ss.name, err)
		s.count("scale-failed")
		return
	}
	s.log("scale %s to %d", ss.name, n)
	s.count("scale")
}

// deletePod deletes a random live pod of the sets (leased or not); the
// soak records it first, so the pod watch knows who deleted it.
func (s *soak) deletePod() {
	ctx := context.Background()
	var all []corev1.Pod
	for _, n := range s.setNames() {
		pods, err := s.e.livePods(ctx, n)
		if err != nil {
			s.count("delete-pod-failed")
			return
		}
		all = append(all, pods...)
	}
	if len(all) == 0 {
		s.count("delete-pod-none")
		return
	}
	p := all[s.rng.IntN(len(all))]
	s.mu.Lock()
	s.soakDeleted[p.UID] = true
	delete(s.held, p.Name)
	s.mu.Unlock()
	err := s.e.c.Client().CoreV1().Pods(s.e.ns).Delete(ctx, p.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &p.UID}})
	if err != nil {
		s.log("delete pod %s: %v", p.Name, err)
		s.count("delete-pod-failed")
		return
	}
	_, leased := p.Labels[v1alpha1.LeaseLabel]
	s.log("deleted pod %s (leased=%v)", p.Name, leased)
	s.count("delete-pod")
}

// killQEMU sends SIGKILL to a random VM's QEMU.
func (s *soak) killQEMU() {
	vms := qemuByUID(s.stateDir)
	if len(vms) == 0 {
		s.count("kill-qemu-none")
		return
	}
	uids := make([]string, 0, len(vms))
	for u := range vms {
		uids = append(uids, string(u))
	}
	slices.Sort(uids)
	u := types.UID(s.pick(uids...))
	for _, pid := range vms[u] {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	s.log("kill -9 QEMU %v of pod %s", vms[u], u)
	s.count("kill-qemu")
}

var vmDirRE = regexp.MustCompile(`/vms/([0-9a-f-]{36})/`)

// qemuByUID maps each pod UID under stateDir/vms to its QEMU pids.
func qemuByUID(stateDir string) map[types.UID][]int {
	out := map[types.UID][]int{}
	for _, pid := range vmtest.QEMUPids(filepath.Join(stateDir, "vms")) {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err != nil {
			continue
		}
		if m := vmDirRE.FindSubmatch(b); m != nil {
			out[types.UID(m[1])] = append(out[types.UID(m[1])], pid)
		}
	}
	return out
}

// watchPods reports a leased pod that gets deleted (deletionTimestamp set
// or gone) by anyone but the soak: the controller must never delete a
// leased pod. It also sees the lease label of a held pod removed by
// someone else.
func (s *soak) watchPods() {
	f := informers.NewSharedInformerFactoryWithOptions(s.e.c.Client(), 0, informers.WithNamespace(s.e.ns))
	inf := f.Core().V1().Pods().Informer()
	check := func(p *corev1.Pod, gone bool) {
		holder, leased := p.Labels[v1alpha1.LeaseLabel]
		s.mu.Lock()
		mine := s.soakDeleted[p.UID]
		s.mu.Unlock()
		if leased && !mine && (gone || p.DeletionTimestamp != nil) {
			s.violate("leased-deleted/"+string(p.UID), "leased-pod-deleted",
				"pod %s (%s) leased by %s was deleted by someone else than the soak (gone=%v deletionTimestamp=%v)",
				p.Name, p.UID, holder, gone, p.DeletionTimestamp)
		}
	}
	_, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		UpdateFunc: func(_, obj any) {
			if p, ok := obj.(*corev1.Pod); ok {
				check(p, false)
			}
		},
		DeleteFunc: func(obj any) {
			if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = d.Obj
			}
			if p, ok := obj.(*corev1.Pod); ok {
				check(p, true)
			}
		},
	})
	if err != nil {
		s.t.Fatal(err)
	}
	stop := make(chan struct{})
	s.t.Cleanup(func() { close(stop) })
	f.Start(stop)
	f.WaitForCacheSync(stop)
}

// checkLoop runs the continuous checks until ctx ends.
func (s *soak) checkLoop(ctx context.Context) {
	tick := time.NewTicker(soakCheckEvery)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			s.check()
		}
	}
}

// suspect returns how long the state named key has held, counted from
// when it was first seen or the agent last started, whichever is later
// (0 while the agent is down).
func (s *soak) suspect(key string, now time.Time) time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	first, ok := s.since[key]
	if !ok {
		first = now
		s.since[key] = now
	}
	if s.agentUp.IsZero() {
		return 0
	}
	return now.Sub(later(first, s.agentUp))
}

// clear forgets every suspect state not in keep (it was repaired) and
// records how long the longest of each kind lasted (wall clock, agent
// downtime included) for the report.
func (s *soak) clear(keep map[string]bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	for k, first := range s.since {
		if !keep[k] {
			kind, _, _ := strings.Cut(k, "/")
			s.longest[kind] = max(s.longest[kind], now.Sub(first))
			delete(s.since, k)
		}
	}
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// check looks once at the pods and the QEMUs: no QEMU without a pod, at
// most one QEMU per pod, no Ready pod without its QEMU (each beyond its
// grace window), and the soak's leases still on their pods.
func (s *soak) check() {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	// QEMUs first, then pods: a pod created in between has no QEMU yet
	// (harmless), and a QEMU seen has its pod in the later list if the
	// pod still exists.
	vms := qemuByUID(s.stateDir)
	l, err := s.e.c.Client().CoreV1().Pods(s.e.ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return // the API server is loaded: look again next tick
	}
	now := time.Now()
	keep := map[string]bool{}
	pods := map[types.UID]*corev1.Pod{}
	for i := range l.Items {
		pods[l.Items[i].UID] = &l.Items[i]
	}
	for uid, pids := range vms {
		if _, ok := pods[uid]; !ok {
			key := "orphan/" + string(uid)
			keep[key] = true
			if d := s.suspect(key, now); d > soakOrphanGrace {
				s.violate(key, "qemu-without-pod", "QEMU %v of pod %s runs %s after its pod left the API server (agent up that long)", pids, uid, d.Round(time.Second))
			}
		}
		if len(pids) > 1 {
			key := "dup/" + string(uid)
			keep[key] = true
			if d := s.suspect(key, now); d > soakOrphanGrace {
				s.violate(key, "two-qemu-per-pod", "pod %s has %d QEMUs %v for %s", uid, len(pids), pids, d.Round(time.Second))
			}
		}
	}
	for uid, p := range pods {
		if p.DeletionTimestamp != nil || !podReady(p) {
			continue
		}
		if _, ok := vms[uid]; !ok {
			key := "ready/" + string(uid)
			keep[key] = true
			if d := s.suspect(key, now); d > soakReadyGrace {
				s.violate(key, "ready-without-qemu", "pod %s (%s) Ready with no QEMU for %s (agent up that long)", p.Name, uid, d.Round(time.Second))
			}
		}
	}
	s.mu.Lock()
	held := make(map[string]soakLease, len(s.held))
	for k, v := range s.held {
		held[k] = v
	}
	s.mu.Unlock()
	for name, h := range held {
		for _, p := range pods {
			if p.Name == name && p.UID == h.uid && p.Labels[v1alpha1.LeaseLabel] != h.holder {
				// Re-read under the lock: a concurrent release may have
				// dropped it from held.
				s.mu.Lock()
				still := s.held[name] == h
				s.mu.Unlock()
				if still {
					s.violate("stolen/"+string(p.UID), "lease-lost", "pod %s held by %s now has lease label %q", name, h.holder, p.Labels[v1alpha1.LeaseLabel])
				}
			}
		}
	}
	s.clear(keep)
}

// settle waits until the sets converge with the soak's leases kept, every
// live pod is Ready with exactly one QEMU, no other QEMU runs and the state
// dir holds exactly the live pods' VMs. What is still off after soakSettle
// is a violation.
func (s *soak) settle() {
	s.log("settling (up to %s)", soakSettle)
	start := time.Now()
	var problems []string
	first := true
	err := wait.PollUntilContextTimeout(context.Background(), 2*time.Second, soakSettle, true, func(ctx context.Context) (bool, error) {
		problems = s.convergence(ctx)
		if first && len(problems) > 0 {
			s.log("not settled yet: %s", strings.Join(problems, "; "))
		}
		first = false
		return len(problems) == 0, nil
	})
	if err != nil {
		for _, p := range problems {
			s.violate("settle/"+p, "no-convergence", "after %s: %s", soakSettle, p)
		}
		return
	}
	s.log("converged %s after the chaos stopped", time.Since(start).Round(time.Second))
}

// convergence lists what differs from the settled state.
func (s *soak) convergence(ctx context.Context) []string {
	var out []string
	l, err := s.e.c.Client().CoreV1().Pods(s.e.ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return []string{fmt.Sprintf("list pods: %v", err)}
	}
	vms := qemuByUID(s.stateDir)
	live := map[types.UID]bool{}
	for i := range l.Items {
		p := &l.Items[i]
		live[p.UID] = true
		if p.DeletionTimestamp != nil {
			out = append(out, fmt.Sprintf("pod %s still terminating", p.Name))
			continue
		}
		if !podReady(p) {
			out = append(out, fmt.Sprintf("pod %s not Ready (%s)", p.Name, podTag(p)))
		}
		if n := len(vms[p.UID]); n != 1 {
			out = append(out, fmt.Sprintf("pod %s has %d QEMUs", p.Name, n))
		}
	}
	for uid, pids := range vms {
		if !live[uid] {
			out = append(out, fmt.Sprintf("QEMU %v of a pod %s not in the API server", pids, uid))
		}
	}
	ents, err := os.ReadDir(filepath.Join(s.stateDir, "vms"))
	if err != nil && !os.IsNotExist(err) {
		out = append(out, fmt.Sprintf("read state dir: %v", err))
	}
	for _, d := range ents {
		if !live[types.UID(d.Name())] {
			out = append(out, fmt.Sprintf("state dir vms/%s of no pod", d.Name()))
		}
	}
	for uid := range live {
		if _, err := os.Stat(filepath.Join(s.stateDir, "vms", string(uid))); err != nil {
			out = append(out, fmt.Sprintf("pod %s has no state dir: %v", uid, err))
		}
	}
	s.mu.Lock()
	leased := map[string]int32{}
	for name, h := range s.held {
		for i := range l.Items {
			if p := &l.Items[i]; p.Name == name && p.UID == h.uid {
				leased[h.set]++
			}
		}
	}
	s.mu.Unlock()
	for _, ss := range s.sets {
		var set v1alpha1.ExporterSet
		if err := s.e.cl.Get(ctx, client.ObjectKey{Namespace: s.e.ns, Name: ss.name}, &set); err != nil {
			out = append(out, fmt.Sprintf("get %s: %v", ss.name, err))
			continue
		}
		n := leased[ss.name]
		target := max(controller.Target(*set.Spec.Replicas, ss.minAvail, n, 0, ptr.To(ss.cap)), n)
		want := counts{target, target, target, target - n, n}
		if got := statusCounts(&set); got != want || set.Status.ObservedGeneration != set.Generation {
			out = append(out, fmt.Sprintf("exporterset %s: status %s (generation %d observed %d), want %s",
				ss.name, got, set.Generation, set.Status.ObservedGeneration, want))
		}
		pods, err := s.e.livePods(ctx, ss.name)
		if err == nil && int32(len(pods)) != target {
			out = append(out, fmt.Sprintf("exporterset %s: %d live pods, want %d", ss.name, len(pods), target))
		}
	}
	slices.Sort(out)
	return out
}

// checkAgentLog reports the status updates the API server refused the
// agent (forbidden, invalid): each is a pod status lost. Conflicts are
// not: the library reads the pod again and retries.
func (s *soak) checkAgentLog() {
	b, err := os.ReadFile(s.agent.log)
	if err != nil {
		s.violate("agent-log", "agent-log", "read %s: %v", s.agent.log, err)
		return
	}
	for _, l := range strings.Split(string(b), "\n") {
		if !strings.Contains(l, "Error processing pod status update") {
			continue
		}
		if strings.Contains(l, "is forbidden") || strings.Contains(l, "is invalid") {
			_, msg, _ := strings.Cut(l, "err=")
			s.violate("refused/"+msg, "status-update-refused", "%s", strings.TrimSpace(l))
		}
	}
}

// report logs the run and fails the test on any violation.
func (s *soak) report(t *testing.T, d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	kinds := make([]string, 0, len(s.events))
	for k := range s.events {
		kinds = append(kinds, k)
	}
	slices.Sort(kinds)
	var b strings.Builder
	fmt.Fprintf(&b, "soak report: %s (chaos + settle), load average now %s\nevents:\n", d.Round(time.Second), loadAvg())
	total := 0
	for _, k := range kinds {
		fmt.Fprintf(&b, "  %-28s %d\n", k, s.events[k])
		total += s.events[k]
	}
	fmt.Fprintf(&b, "  %-28s %d\nlongest repaired (seen every %s; agent downtime included):\n", "total", total, soakCheckEvery)
	for _, k := range []string{"orphan", "dup", "ready"} {
		fmt.Fprintf(&b, "  %-28s %s\n", map[string]string{"orphan": "qemu-without-pod", "dup": "two-qemu-per-pod", "ready": "ready-without-qemu"}[k], s.longest[k].Round(time.Second))
	}
	fmt.Fprintf(&b, "violations: %d\n", len(s.violations))
	for _, v := range s.violations {
		fmt.Fprintf(&b, "  %s %s: %s\n", v.at.UTC().Format(time.RFC3339), v.kind, v.detail)
	}
	t.Log(b.String())
	for _, v := range s.violations {
		t.Errorf("violation %s at %s: %s", v.kind, v.at.UTC().Format(time.RFC3339), v.detail)
	}
}

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}

// soakProc is a process the soak kills and restarts. Only the chaos
// goroutine (and cleanup) calls its methods.
type soakProc struct {
	name, bin, log string
	args           []string
	cmd            *exec.Cmd
	done           chan struct{}
}

func (p *soakProc) start(tb testing.TB) {
	logf, err := os.OpenFile(p.log, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		tb.Fatal(err)
	}
	fmt.Fprintf(logf, "=== soak: start %s at %s\n", p.name, time.Now().UTC().Format(time.RFC3339))
	cmd := exec.Command(p.bin, p.args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// Its own process group, so that a terminal's signals do not reach it;
	// kill9 signals the process only: VMs outlive their agent, as after a
	// crash.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		logf.Close()
		tb.Fatalf("start %s: %v", p.name, err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		logf.Close()
		close(done)
	}()
	p.cmd, p.done = cmd, done
}

func (p *soakProc) running() bool {
	if p.done == nil {
		return false
	}
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

func (p *soakProc) kill9() {
	if !p.running() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// stop sends SIGTERM, then SIGKILL after 15 s.
func (p *soakProc) stop() {
	if !p.running() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(15 * time.Second):
		p.kill9()
	}
}

// outageProxy forwards TCP connections to a registry; while down it
// closes them at once (the registry is unreachable).
type outageProxy struct {
	addr string
	down atomic.Bool
}

func startOutageProxy(tb testing.TB, target string) *outageProxy {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	p := &outageProxy{addr: l.Addr().String()}
	var wg sync.WaitGroup
	tb.Cleanup(func() { l.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			if p.down.Load() {
				c.Close()
				continue
			}
			go func() {
				defer c.Close()
				u, err := net.DialTimeout("tcp", target, 10*time.Second)
				if err != nil {
					return
				}
				defer u.Close()
				go func() { _, _ = io.Copy(u, c); u.(*net.TCPConn).CloseWrite() }()
				_, _ = io.Copy(c, u)
			}()
		}
	}()
	return p
}

// setDown starts or ends the outage. Connections open when it starts are
// left to finish (a pull in flight completes or times out on its own).
func (p *outageProxy) setDown(down bool) { p.down.Store(down) }
