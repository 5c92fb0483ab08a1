// Package ocitest starts real OCI registries and pushes real artifacts for
// tests of the oci package: the Debian docker-registry binary (CNCF
// distribution) on a free loopback port, optionally behind htpasswd auth; a
// counting, fault-injecting reverse proxy; the oras CLI built by
// hack/build-oras.sh; and OCI layouts written by hand for skopeo to push.
package ocitest

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/pinned"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

// RepoRoot is the directory holding go.mod (see internal/testutil).
func RepoRoot(tb testing.TB) string { return testutil.MustRepoRoot(tb) }

// Oras returns the path of the oras CLI, building it (cached) if needed.
func Oras(tb testing.TB) string {
	tb.Helper()
	testutil.SkipIfShort(tb, "the oras CLI")
	out, err := exec.Command(filepath.Join(RepoRoot(tb), "hack", "build-oras.sh")).Output()
	if err != nil {
		var stderr string
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		tb.Fatalf("hack/build-oras.sh: %v\n%s", err, stderr)
	}
	return strings.TrimSpace(string(out))
}

// Registry is a running docker-registry.
type Registry struct {
	Addr string // host:port (127.0.0.1 unless RegistryOptions.Host)
	Root string // storage root directory
	User string // set when auth is on
	Pass string
	Log  string // path of the registry's log file
}

// RegistryOptions configure StartRegistry.
type RegistryOptions struct {
	// User and Pass, when set, turn on htpasswd (bcrypt) auth.
	User, Pass string
	// Host is the IPv4 address to listen on; default 127.0.0.1. A
	// non-loopback one serves clients in other network namespaces (they
	// need plainHTTP for it in their registry settings).
	Host string
}

// StartRegistry runs /usr/bin/docker-registry on a free port of o.Host
// (loopback by default) until the test ends.
func StartRegistry(tb testing.TB, o RegistryOptions) *Registry {
	tb.Helper()
	testutil.SkipIfShort(tb, "a docker-registry")
	dir := tb.TempDir()
	r := &Registry{Root: filepath.Join(dir, "storage"), User: o.User, Pass: o.Pass, Log: filepath.Join(dir, "registry.log")}
	host := o.Host
	if host == "" {
		host = "127.0.0.1"
	}
	r.Addr = freeAddr(tb, host)
	auth := ""
	if o.User != "" {
		out, err := exec.Command("htpasswd", "-Bbn", o.User, o.Pass).Output()
		if err != nil {
			tb.Fatalf("htpasswd: %v", err)
		}
		hp := filepath.Join(dir, "htpasswd")
		if err := os.WriteFile(hp, bytes.TrimSpace(out), 0o600); err != nil {
			tb.Fatal(err)
		}
		auth = fmt.Sprintf("auth:\n  htpasswd:\n    realm: test\n    path: %s\n", hp)
	}
	cfg := fmt.Sprintf(`version: 0.1
log:
  level: info
  formatter: text
  accesslog:
    disabled: false
storage:
  filesystem:
    rootdirectory: %s
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: %s
%s`, r.Root, r.Addr, auth)
	cfgPath := filepath.Join(dir, "config.yml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		tb.Fatal(err)
	}
	logf, err := os.Create(r.Log)
	if err != nil {
		tb.Fatal(err)
	}
	cmd := exec.Command("/usr/bin/docker-registry", "serve", cfgPath)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := pinned.Start(cmd); err != nil {
		tb.Fatalf("start docker-registry: %v", err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	tb.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-exited
		logf.Close()
	})
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := http.Get("http://" + r.Addr + "/v2/")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK || resp.StatusCode == http.StatusUnauthorized {
				return r
			}
		}
		select {
		case <-exited:
			b, _ := os.ReadFile(r.Log)
			tb.Fatalf("docker-registry exited:\n%s", b)
		default:
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(r.Log)
			tb.Fatalf("docker-registry not ready on %s: %v\n%s", r.Addr, err, b)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// BlobPath is where the registry stores a blob ("sha256:<hex>").
func (r *Registry) BlobPath(dgst string) string {
	alg, hex, _ := strings.Cut(dgst, ":")
	return filepath.Join(r.Root, "docker", "registry", "v2", "blobs", alg, hex[:2], hex, "data")
}

func freeAddr(tb testing.TB, host string) string {
	tb.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		tb.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// Run runs a command (in dir if not empty), failing the test with its output
// on error. It is killed when ctx ends.
func Run(ctx context.Context, tb testing.TB, dir string, name string, args ...string) string {
	tb.Helper()
	out, err := RunErr(ctx, dir, name, args...)
	if err != nil {
		tb.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return out
}

// RunErr runs a command and returns its combined output.
func RunErr(ctx context.Context, dir string, name string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := pinned.Run(cmd)
	return out.String(), err
}
