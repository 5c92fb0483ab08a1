package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
)

// builds holds the commands the tests run (qemu-kubelet,
// exporterset-controller, kubectl-exs), each built once per test process:
// the tests ask for the same few binaries, and a link
// costs seconds of CPU each time. Owned by goBuildShared; dir is made on
// first use and removed by TestMain.
var builds struct {
	mu   sync.Mutex
	dir  string
	bins map[string]*sharedBin
}

type sharedBin struct {
	once sync.Once
	dir  string // its own directory under builds.dir
	path string
	err  error
}

// goBuildShared builds pkg of the module at root with ldflags (may be
// empty) once per process and returns the binary's path; concurrent callers
// of one (pkg, ldflags) wait for the same build.
func goBuildShared(root, pkg, ldflags string) (string, error) {
	key := pkg + "\x00" + ldflags
	builds.mu.Lock()
	if builds.bins == nil {
		builds.bins = map[string]*sharedBin{}
	}
	if builds.dir == "" {
		d, err := os.MkdirTemp("", "qk-e2e-bin-")
		if err != nil {
			builds.mu.Unlock()
			return "", fmt.Errorf("make the shared build dir: %w", err)
		}
		builds.dir = d
	}
	b := builds.bins[key]
	if b == nil {
		b = &sharedBin{dir: filepath.Join(builds.dir, fmt.Sprint(len(builds.bins)))}
		builds.bins[key] = b
	}
	builds.mu.Unlock()

	b.once.Do(func() {
		if err := os.MkdirAll(b.dir, 0o755); err != nil {
			b.err = err
			return
		}
		out := filepath.Join(b.dir, filepath.Base(pkg))
		args := []string{"build"}
		if ldflags != "" {
			args = append(args, "-ldflags", ldflags)
		}
		cmd := exec.Command("go", append(args, "-o", out, pkg)...)
		cmd.Dir = root
		if o, err := cmd.CombinedOutput(); err != nil {
			b.err = fmt.Errorf("go build %s: %v\n%s", pkg, err, o)
			return
		}
		b.path = out
	})
	return b.path, b.err
}

// removeSharedBuilds removes what goBuildShared built (TestMain, after the
// tests).
func removeSharedBuilds() {
	builds.mu.Lock()
	defer builds.mu.Unlock()
	if builds.dir != "" {
		_ = os.RemoveAll(builds.dir)
	}
}

// placeBinary links the shared binary src at dst, so a test that hands a
// directory to a tool (a kubectl plugin dir, a PATH entry) finds it there.
func placeBinary(src, dst string) error { return os.Symlink(src, dst) }

// The commands the tests build. Every test runs the one build of
// qemu-kubelet, stamped with kubeletVersion (the node's kubeletVersion).
const (
	kubeletPkg     = "./cmd/qemu-kubelet"
	kubeletVersion = "v0.1.0-e2e"
	ctrlPkg        = "./cmd/exporterset-controller"
)

// ldflagsFor is the -ldflags of the tests' build of pkg: the version stamp
// for qemu-kubelet, none for the others.
func ldflagsFor(pkg string) string {
	if pkg == kubeletPkg {
		return "-X main.version=" + kubeletVersion
	}
	return ""
}

// prebuild starts building pkgs of the repository in the background, so
// that the builds overlap what a test starts next (the control plane, the
// registry); goBuild and buildQemuKubelet then wait for the build under way
// and report its error.
func prebuild(tb testing.TB, pkgs ...string) {
	tb.Helper()
	root := ocitest.RepoRoot(tb)
	for _, pkg := range pkgs {
		go func() { _, _ = goBuildShared(root, pkg, ldflagsFor(pkg)) }()
	}
}

// goBuild builds pkg of the module at root (once per test process) and
// places it in dir; it returns the binary in dir.
func goBuild(tb testing.TB, root, dir, pkg string) string {
	tb.Helper()
	return placeBuilt(tb, root, dir, pkg, ldflagsFor(pkg))
}

func placeBuilt(tb testing.TB, root, dir, pkg, ldflags string) string {
	tb.Helper()
	src, err := goBuildShared(root, pkg, ldflags)
	if err != nil {
		tb.Fatal(err)
	}
	out := filepath.Join(dir, filepath.Base(pkg))
	if err := placeBinary(src, out); err != nil {
		tb.Fatalf("place %s in %s: %v", filepath.Base(pkg), dir, err)
	}
	return out
}
