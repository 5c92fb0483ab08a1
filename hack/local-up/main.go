// Command local-up is what `make run` runs: a local control plane (package
// e2e/cluster), one qemu-kubelet virtual node (or --nodes of them, `make run
// NODES=3`), the exporterset-controller with
// its CRD, a local registry holding the test OS image (pushed with oras), and
// a sample ExporterSet booting VMs from it. It prints how to reach the
// cluster and a one-line `kubectl run` that boots a VM, stays in the
// foreground, and stops and cleans up everything (VMs included) on Ctrl-C.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/qemu-kubelet/qemu-kubelet/internal/pinned"
)

func main() {
	binDir := flag.String("bin-dir", "bin", "directory holding the qemu-kubelet and exporterset-controller binaries")
	nodeName := flag.String("node-name", "qemu-node-1", "name of the virtual node (with --nodes > 1: its trailing -<number> counts up)")
	nodes := flag.Int("nodes", 1, "number of virtual nodes, each a qemu-kubelet with its own port and state directory")
	keep := flag.Bool("keep", false, "keep the state directory (logs, kubeconfigs) after exit")
	flag.Parse()
	names, err := nodeNames(*nodeName, *nodes)
	if err != nil {
		fmt.Fprintf(os.Stderr, "local-up: %v\n", err)
		os.Exit(2)
	}
	if err := run(*binDir, names, *keep); err != nil {
		fmt.Fprintf(os.Stderr, "local-up: %v\n", err)
		os.Exit(1)
	}
}

// nodeNames is base alone for n = 1, else base without its trailing
// -<number>, then -1 ... -n.
func nodeNames(base string, n int) ([]string, error) {
	if n < 1 || n > 20 {
		return nil, fmt.Errorf("--nodes %d: want 1 to 20", n)
	}
	if n == 1 {
		return []string{base}, nil
	}
	stem := strings.TrimRight(base, "0123456789")
	if stem == base || !strings.HasSuffix(stem, "-") {
		stem = base + "-"
	}
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s%d", stem, i+1)
	}
	return out, nil
}

func run(binDir string, names []string, keep bool) error {
	nodeName := names[0]
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	binDir, err := filepath.Abs(binDir)
	if err != nil {
		return err
	}
	fmt.Println("local-up: starting the control plane (first run builds it: ~5 min)...")
	c, err := cluster.Start(ctx, cluster.Options{KeepDir: keep, Logf: func(f string, a ...any) { fmt.Printf("local-up: "+f+"\n", a...) }})
	if err != nil {
		return err
	}
	defer c.Stop()
	var procs []*exec.Cmd
	defer func() {
		for i := len(procs) - 1; i >= 0; i-- {
			_ = syscall.Kill(-procs[i].Process.Pid, syscall.SIGTERM)
		}
	}()

	// The virtual nodes. Their kubelet APIs listen on the host's address:
	// the API server refuses to proxy (logs, attach) to a loopback node
	// address. With several nodes each has its own port, state dir and log.
	stateDir := filepath.Join(c.Dir(), "qemu-kubelet")
	// QEMU runs as the nodes' vmUser (107): it searches its way to the
	// VM directories (the agents give the state dirs themselves its group).
	if err := os.Chmod(c.Dir(), 0o711); err != nil {
		return err
	}
	if err := os.MkdirAll(stateDir, 0o711); err != nil {
		return err
	}
	for _, name := range names {
		nodeState, cfgPath, logName := stateDir, filepath.Join(c.Dir(), "qemu-kubelet.yaml"), "qemu-kubelet"
		if len(names) > 1 {
			nodeState = filepath.Join(stateDir, name)
			cfgPath = filepath.Join(c.Dir(), "qemu-kubelet-"+name+".yaml")
			logName = "qemu-kubelet-" + name
		}
		p, err := startNode(c, binDir, name, nodeState, cfgPath, logName)
		if err != nil {
			return err
		}
		procs = append(procs, p)
	}
	for _, name := range names {
		fmt.Printf("local-up: waiting for node %s to be Ready...\n", name)
		if err := waitNodeReady(ctx, c, name); err != nil {
			return fmt.Errorf("%w (see %s)", err, filepath.Join(c.Dir(), "logs"))
		}
	}

	// VMs stop with their pods: delete them all before the nodes go, so no
	// QEMU outlives local-up (stateDir holds every node's).
	defer stopVMs(c, stateDir)

	root, err := cluster.RepoRoot()
	if err != nil {
		return err
	}
	// A local registry holding the test OS image the sample pool boots.
	fmt.Println("local-up: starting a local registry on " + registryAddr + " and pushing the test OS image (first run builds it: ~1 min)...")
	reg, err := startRegistry(c)
	if err != nil {
		return err
	}
	procs = append(procs, reg)
	if err := pushTestImage(ctx, root, c.Dir()); err != nil {
		return err
	}

	// The controller, its CRD and a sample pool.
	if _, err := c.Kubectl(ctx, "apply", "--server-side", "-f", filepath.Join(root, "config", "crd")); err != nil {
		return err
	}
	if err := wait.PollUntilContextTimeout(ctx, 300*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		out, err := c.Kubectl(ctx, "get", "crd/exportersets.qemu-kubelet.io", "-o", `jsonpath={.status.conditions[?(@.type=="Established")].status}`)
		return err == nil && out == "True", nil
	}); err != nil {
		return fmt.Errorf("ExporterSet CRD not established: %w", err)
	}
	p, err := spawn(c, filepath.Join(binDir, "exporterset-controller"), "exporterset-controller",
		"--kubeconfig="+c.AdminKubeconfig(), "--metrics-bind-address=127.0.0.1:0", "--health-probe-bind-address=127.0.0.1:0")
	if err != nil {
		return err
	}
	procs = append(procs, p)
	if _, err := c.Kubectl(ctx, "apply", "-f", filepath.Join(root, "config", "samples", "exporterset.yaml")); err != nil {
		return err
	}

	fwd, err := localPort(8080)
	if err != nil {
		return err
	}
	fmt.Print(readyText(c.AdminKubeconfig(), c.BinDir(), nodeName, fwd, filepath.Join(c.Dir(), "logs")))

	select {
	case <-ctx.Done():
	case <-exited(procs):
		fmt.Println("local-up: a component exited; stopping (see logs above)")
	}
	fmt.Println("local-up: stopping...")
	return nil
}

// startNode writes node name's config (its state dir, a free port) and
// starts its qemu-kubelet, logging to logs/<logName>.log.
func startNode(c *cluster.Cluster, binDir, name, stateDir, cfgPath, logName string) (*exec.Cmd, error) {
	nodeKC, err := c.NodeKubeconfig(name)
	if err != nil {
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	cfg := fmt.Sprintf(`apiVersion: qemu-kubelet.io/v1alpha1
kind: NodeConfiguration
nodeName: %s
stateDir: %s
maxVMs: 8
accelerator:
  policy: prefer-kvm
server:
  port: %d
  clientCAFile: %s
`, name, stateDir, port, c.CAFile())
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		return nil, err
	}
	return spawn(c, filepath.Join(binDir, "qemu-kubelet"), logName, "--config="+cfgPath, "--kubeconfig="+nodeKC)
}

// step is one command printed for the user to paste, with a comment.
type step struct{ cmd, comment string }

// readyText is what local-up prints once everything runs: how to reach the
// cluster and commands to try, each command on its own line indented by two
// spaces (a `# comment` may follow it); e2e's TestQuickStart runs them as
// printed. PATH gets the kubectl built with the control plane first (its
// version is the server's: another kubectl on PATH may be out of the
// supported skew); fwdPort is the local port of the port-forward example.
func readyText(kubeconfig, cpBin, node string, fwdPort int, logs string) string {
	env := []step{
		{cmd: "export KUBECONFIG=" + kubeconfig},
		{cmd: "export PATH=" + cpBin + ":$PATH", comment: "kubectl of the control plane's version"},
	}
	pool := []step{
		{cmd: "kubectl describe node " + node},
		{cmd: "kubectl get exportersets,pods -o wide"},
		{cmd: "kubectl scale exporterset/sample-pool --replicas=3"},
	}
	vm := []step{
		{cmd: kubectlRunLine()},
		{cmd: "kubectl get pod vm1 -o wide -w"},
		{cmd: "kubectl logs -f vm1", comment: "the serial console"},
		{cmd: "kubectl attach -it vm1", comment: "type into it (the test image echoes lines)"},
		{cmd: fmt.Sprintf("kubectl port-forward pod/vm1 %d:8080", fwdPort), comment: fmt.Sprintf("then: curl localhost:%d", fwdPort)},
	}
	var b strings.Builder
	block := func(steps ...step) {
		b.WriteString("\n")
		for _, s := range steps {
			if s.comment == "" {
				fmt.Fprintf(&b, "  %s\n", s.cmd)
			} else {
				fmt.Fprintf(&b, "  %-38s # %s\n", s.cmd, s.comment)
			}
		}
	}
	b.WriteString("\nlocal-up: ready. In another shell:\n")
	block(append(env, pool...)...)
	b.WriteString("\nBoot a VM of your own and watch its serial console:\n")
	block(vm...)
	fmt.Fprintf(&b, "\nLogs: %s\nPress Ctrl-C to stop and clean up.\n", logs)
	return b.String()
}

// localPort is want if it is free on loopback, else a free port.
func localPort(want int) (int, error) {
	if l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", want)); err == nil {
		l.Close()
		return want, nil
	}
	return freePort()
}

func spawn(c *cluster.Cluster, bin, name string, args ...string) (*exec.Cmd, error) {
	logf, err := os.Create(filepath.Join(c.Dir(), "logs", name+".log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := pinned.Start(cmd); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	return cmd, nil
}

// exited is closed when any of procs exits.
func exited(procs []*exec.Cmd) <-chan struct{} {
	ch := make(chan struct{})
	var once sync.Once
	for _, p := range procs {
		go func() {
			_ = p.Wait()
			once.Do(func() { close(ch) })
		}()
	}
	return ch
}

func waitNodeReady(ctx context.Context, c *cluster.Cluster, name string) error {
	return wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
		n, err := c.Client().CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, cond := range n.Status.Conditions {
			if cond.Type == corev1.NodeReady {
				return cond.Status == corev1.ConditionTrue, nil
			}
		}
		return false, nil
	})
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
