package build

import (
	"os/exec"
	"strings"
	"testing"
)

// TestDependencyDirection keeps the layering of docs/architecture.md: qemu and oci
// know nothing of Kubernetes (nor of each other), and the controller knows
// nothing of QEMU or OCI images; the jumpstarter protocol packages know
// nothing of Kubernetes, QEMU, OCI, the provider or the controller; the
// kubectl plugin (internal/exs) is an API client that speaks the label
// protocol and knows nothing of the controller's or the node's code; the
// provider's leaf packages (docs/architecture.md) know nothing of the
// provider package itself.
func TestDependencyDirection(t *testing.T) {
	const mod = "github.com/qemu-kubelet/qemu-kubelet/"
	rules := []struct {
		pkg       string
		forbidden []string
	}{
		{"qemu", []string{"k8s.io/", "sigs.k8s.io/", "github.com/virtual-kubelet/", mod + "oci", mod + "provider"}},
		{"oci", []string{"k8s.io/", "sigs.k8s.io/", "github.com/virtual-kubelet/", mod + "qemu", mod + "provider"}},
		{"controller", []string{mod + "qemu", mod + "oci", mod + "provider", "github.com/virtual-kubelet/"}},
		{"api/v1alpha1", []string{mod + "qemu", mod + "oci", mod + "provider", mod + "controller"}},
		{"api/jumpstarter/v1alpha1", []string{mod + "qemu", mod + "oci", mod + "provider", mod + "controller", mod + "jumpstarter"}},
		{"api/virtualtarget/v1alpha1", []string{mod + "qemu", mod + "oci", mod + "provider", mod + "controller", mod + "jumpstarter", mod + "api/v1alpha1"}},
		{"internal/exs", []string{mod + "qemu", mod + "oci", mod + "provider", mod + "controller", mod + "jumpstarter", "github.com/virtual-kubelet/"}},
		{"cmd/kubectl-exs", []string{mod + "qemu", mod + "oci", mod + "provider", mod + "controller", mod + "jumpstarter", "github.com/virtual-kubelet/"}},
		// The provider's leaves know nothing of the provider (its pod
		// worker, pod record and kubelet entry points): "$" ends an exact
		// package path.
		{"provider/podspec", []string{mod + "provider$", "github.com/virtual-kubelet/", mod + "controller", mod + "jumpstarter"}},
		{"provider/podstatus", []string{mod + "provider$", mod + "provider/nodestatus", "github.com/virtual-kubelet/", mod + "controller", mod + "jumpstarter"}},
		{"provider/telemetry", []string{mod + "provider$", mod + "provider/nodestatus", "github.com/virtual-kubelet/", mod + "controller"}},
		{"provider/guest", []string{mod + "provider$", mod + "provider/podspec", mod + "provider/podstatus", mod + "provider/nodestatus", mod + "provider/telemetry", mod + "controller", mod + "jumpstarter"}},
		{"provider/probe", []string{mod + "provider$", mod + "provider/podspec", mod + "provider/podstatus", mod + "provider/nodestatus", mod + "provider/telemetry", mod + "controller", mod + "jumpstarter"}},
		{"provider/snapshot", []string{mod + "provider$", mod + "provider/podspec", mod + "provider/podstatus", mod + "provider/nodestatus", mod + "provider/telemetry", mod + "provider/guest", mod + "provider/probe", "k8s.io/api/", "k8s.io/client-go/", "github.com/virtual-kubelet/", mod + "controller", mod + "jumpstarter"}},
		{"provider/stats", []string{mod + "provider$", mod + "provider/podspec", mod + "provider/podstatus", mod + "provider/telemetry", mod + "provider/guest", mod + "provider/probe", mod + "provider/snapshot", "github.com/virtual-kubelet/", mod + "controller", mod + "jumpstarter"}},
		{"provider/poddisk", []string{mod + "provider$", mod + "provider/podspec", mod + "provider/podstatus", mod + "provider/telemetry", mod + "provider/guest", mod + "provider/probe", mod + "provider/snapshot", mod + "provider/stats", "github.com/virtual-kubelet/", mod + "controller", mod + "jumpstarter"}},
		{"provider/exporter", []string{mod + "provider$", mod + "provider/nodestatus", mod + "provider/telemetry", mod + "provider/probe", mod + "provider/snapshot", mod + "controller"}},
		{"provider/kubeletapi", []string{mod + "provider$", mod + "provider/podspec", mod + "provider/podstatus", mod + "provider/nodestatus", mod + "provider/telemetry", mod + "provider/guest", mod + "provider/probe", mod + "provider/snapshot", mod + "provider/stats", mod + "provider/poddisk", mod + "oci", mod + "controller", mod + "jumpstarter"}},
		{"provider/teardown", []string{mod + "provider$", mod + "provider/podspec", mod + "provider/podstatus", mod + "provider/nodestatus", mod + "provider/telemetry", mod + "provider/guest", mod + "provider/probe", mod + "provider/snapshot", mod + "provider/stats", mod + "provider/poddisk", mod + "provider/kubeletapi", mod + "oci", "github.com/virtual-kubelet/", mod + "controller", mod + "jumpstarter"}},
		{"provider/nodestatus", []string{mod + "provider$", mod + "provider/podspec", "github.com/virtual-kubelet/", mod + "controller", mod + "jumpstarter"}},
		{"jumpstarter/...", []string{"k8s.io/", "sigs.k8s.io/", "github.com/virtual-kubelet/", mod + "qemu", mod + "oci", mod + "provider", mod + "controller"}},
	}
	for _, r := range rules {
		out, err := exec.Command("go", "list", "-deps", "../"+r.pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go list -deps %s: %v\n%s", r.pkg, err, out)
		}
		for _, dep := range strings.Fields(string(out)) {
			for _, f := range r.forbidden {
				if exact, ok := strings.CutSuffix(f, "$"); ok && dep == exact || !ok && strings.HasPrefix(dep, f) {
					t.Errorf("package %s depends on %s (forbidden prefix %s)", r.pkg, dep, f)
				}
			}
		}
	}
}
