package probe

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/guest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
)

// guestProber runs one probe's checks against a VM.
type guestProber struct {
	vm    VM
	probe *corev1.Probe
	c     *corev1.Container
	// hostPorts: guest port -> forwarded host port (added on first use);
	// under mu (early checks run at once).
	mu        sync.Mutex
	hostPorts map[int]int
}

// check runs the probe once; msg says why it failed.
func (g *guestProber) check(ctx context.Context, timeout time.Duration) (bool, string) {
	h := g.probe.ProbeHandler
	switch {
	case h.TCPSocket != nil:
		port, err := probePort(h.TCPSocket.Port, g.c)
		if err != nil {
			return false, err.Error()
		}
		hp, err := g.forward(ctx, port, timeout)
		if err != nil {
			return false, err.Error()
		}
		return tcpCheck(ctx, boundedQuery(guest.Usernet(g.vm), timeout), hp, port, timeout)
	case h.HTTPGet != nil:
		port, err := probePort(h.HTTPGet.Port, g.c)
		if err != nil {
			return false, err.Error()
		}
		hp, err := g.forward(ctx, port, timeout)
		if err != nil {
			return false, err.Error()
		}
		return httpCheck(ctx, h.HTTPGet, hp, timeout)
	case h.Exec != nil:
		return ExecCheck(ctx, g.vm, h.Exec.Command, timeout)
	case h.GRPC != nil:
		return false, "grpc probes are not supported for VM pods"
	}
	return false, "probe has no handler"
}

// maxProbeOutput bounds the command output quoted in a probe's message.
const maxProbeOutput = 256

// ExecCheck runs an exec probe's command in the guest through the guest
// agent, within timeout.
func ExecCheck(ctx context.Context, vm VM, command []string, timeout time.Duration) (bool, string) {
	if len(command) == 0 || command[0] == "" {
		return false, "exec probe has no command"
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	res, err := vm.GuestExec(ctx, qemu.ExecRequest{Path: command[0], Args: command[1:]})
	if errors.Is(err, context.DeadlineExceeded) {
		return false, fmt.Sprintf("command %q timed out after %s", strings.Join(command, " "), timeout)
	}
	if err != nil {
		return false, err.Error()
	}
	if res.ExitCode != 0 {
		out := strings.TrimSpace(string(res.Stdout) + string(res.Stderr))
		if len(out) > maxProbeOutput {
			out = out[:maxProbeOutput] + "..."
		}
		return false, fmt.Sprintf("command %q exited with %d: %s", strings.Join(command, " "), res.ExitCode, out)
	}
	return true, ""
}

// forward returns the host port forwarded to guestPort, adding the forward
// (a QMP command, bounded by max(timeout, probeQMPMin): a hung QEMU fails
// the probe) on
// first use.
func (g *guestProber) forward(ctx context.Context, guestPort int, timeout time.Duration) (int, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if hp, ok := g.hostPorts[guestPort]; ok {
		return hp, nil
	}
	ctx, cancel := context.WithTimeout(ctx, max(timeout, probeQMPMin))
	defer cancel()
	hp, err := g.vm.ForwardPort(ctx, guestPort, 0)
	if err != nil {
		return 0, err
	}
	g.hostPorts[guestPort] = hp
	recordProbeForward(g.vm, hp)
	return hp, nil
}

func (g *guestProber) close() {
	select {
	case <-g.vm.Done():
		return
	default:
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, hp := range g.hostPorts {
		_ = g.vm.RemoveForward(ctx, hp)
	}
}

// ProbeForwardsFileName lists the probe forwards added to the VM ("<QEMU
// pid> <host port>" lines): forwards a qemu-kubelet that stopped
// (detaching from its VMs) could not remove are removed by the next one
// when it adopts the VM.
const ProbeForwardsFileName = "probe-forwards"

func recordProbeForward(vm VM, hostPort int) {
	f, err := os.OpenFile(filepath.Join(vm.StateDir(), ProbeForwardsFileName), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return // best effort: at worst a forward outlives its prober
	}
	fmt.Fprintf(f, "%d %d\n", vm.Pid(), hostPort)
	f.Close()
}

// staleProbeForwards parses the ledger: the host ports recorded for QEMU
// pid (other pids: earlier VMs, gone). Pure.
func staleProbeForwards(ledger []byte, pid int) []int {
	var out []int
	for _, line := range strings.Split(string(ledger), "\n") {
		f := strings.Fields(line)
		if len(f) != 2 || f[0] != strconv.Itoa(pid) {
			continue
		}
		if p, err := strconv.Atoi(f[1]); err == nil {
			out = append(out, p)
		}
	}
	return out
}

// removeStaleProbeForwards removes the forwards earlier probers of this
// QEMU left behind and empties the ledger.
func removeStaleProbeForwards(ctx context.Context, vm VM) {
	path := filepath.Join(vm.StateDir(), ProbeForwardsFileName)
	b, err := os.ReadFile(path)
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	for _, hp := range staleProbeForwards(b, vm.Pid()) {
		_ = vm.RemoveForward(ctx, hp) // already gone: fine
	}
	os.Remove(path)
}

// probeQMPMin is the least time a probe's QMP command (adding its forward,
// asking for the connection state) gets: on a loaded host QEMU may answer
// later than a 1 s probe timeout, but a hung QEMU must fail the probe.
const probeQMPMin = 5 * time.Second

// boundedQuery bounds each QMP query of q by max(timeout, probeQMPMin): a
// probe against a hung QEMU fails instead of waiting forever.
func boundedQuery(q guest.UsernetQuery, timeout time.Duration) guest.UsernetQuery {
	return func(ctx context.Context) (string, error) {
		ctx, cancel := context.WithTimeout(ctx, max(timeout, probeQMPMin))
		defer cancel()
		return q(ctx)
	}
}

// tcpCheck connects through the forward and waits up to timeout for the
// guest to accept (see awaitGuest).
func tcpCheck(ctx context.Context, query guest.UsernetQuery, hostPort, guestPort int, timeout time.Duration) (bool, string) {
	d := net.Dialer{Timeout: timeout}
	conn, err := d.DialContext(ctx, "tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(hostPort)))
	if err != nil {
		return false, fmt.Sprintf("dial tcp guest port %d: %v", guestPort, err)
	}
	defer conn.Close()
	if _, err := guest.AwaitGuest(ctx, query, conn, hostPort, timeout); err != nil {
		return false, fmt.Sprintf("dial tcp guest port %d: %v", guestPort, err)
	}
	return true, ""
}

// httpCheck is the kubelet's httpGet probe against the forward.
func httpCheck(ctx context.Context, hg *corev1.HTTPGetAction, hostPort int, timeout time.Duration) (bool, string) {
	scheme := "http"
	if hg.Scheme == corev1.URISchemeHTTPS {
		scheme = "https"
	}
	path := hg.Path
	if !strings.HasPrefix(path, "/") {
		path = "/" + path
	}
	url := fmt.Sprintf("%s://127.0.0.1:%d%s", scheme, hostPort, path)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return false, err.Error()
	}
	req.Header.Set("User-Agent", "kube-probe/qemu-kubelet")
	for _, h := range hg.HTTPHeaders {
		if strings.EqualFold(h.Name, "Host") {
			req.Host = h.Value
			continue
		}
		req.Header.Add(h.Name, h.Value)
	}
	tr := &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}, DisableKeepAlives: true} //nolint:gosec // as the kubelet's probes
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}).Do(req)
	if err != nil {
		if errors.Is(err, io.EOF) || strings.Contains(err.Error(), "EOF") || strings.Contains(err.Error(), "connection reset") ||
			strings.Contains(err.Error(), "server closed idle connection") { // the close raced the request write
			return false, fmt.Sprintf("Get %q: %v (nothing listening on guest port %s?)", hg.Path, err, hg.Port.String())
		}
		return false, fmt.Sprintf("Get %q: %v", hg.Path, err)
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, 10<<10)) //nolint:errcheck
	resp.Body.Close()
	if resp.StatusCode >= 200 && resp.StatusCode < 400 {
		return true, ""
	}
	return false, fmt.Sprintf("HTTP probe failed with statuscode: %d", resp.StatusCode)
}
