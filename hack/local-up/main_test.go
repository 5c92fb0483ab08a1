package main

import (
	"strings"
	"testing"
)

// TestReadyText: every command is on its own line, indented by two spaces,
// a comment (if any) after " # ": the form e2e's TestQuickStart parses.
func TestReadyText(t *testing.T) {
	out := readyText("/tmp/x/admin.kubeconfig", "/cp/bin", "qemu-node-1", 18080, "/tmp/x/logs")
	var cmds []string
	for _, l := range strings.Split(out, "\n") {
		if !strings.HasPrefix(l, "  ") {
			continue
		}
		cmd, _, _ := strings.Cut(strings.TrimSpace(l), " # ")
		cmds = append(cmds, strings.TrimSpace(cmd))
	}
	want := []string{
		"export KUBECONFIG=/tmp/x/admin.kubeconfig",
		"export PATH=/cp/bin:$PATH",
		"kubectl describe node qemu-node-1",
		"kubectl get exportersets,pods -o wide",
		"kubectl scale exporterset/sample-pool --replicas=3",
		kubectlRunLine(),
		"kubectl get pod vm1 -o wide -w",
		"kubectl logs -f vm1",
		"kubectl attach -it vm1",
		"kubectl port-forward pod/vm1 18080:8080",
	}
	if strings.Join(cmds, "\n") != strings.Join(want, "\n") {
		t.Errorf("commands:\n%s\nwant:\n%s\nfrom:\n%s", strings.Join(cmds, "\n"), strings.Join(want, "\n"), out)
	}
	if !strings.Contains(out, "# then: curl localhost:18080\n") {
		t.Errorf("the port-forward's comment names the chosen port:\n%s", out)
	}
}

// TestNodeNames: one node keeps its name; several count up from the name's
// stem; a bad count is refused.
func TestNodeNames(t *testing.T) {
	for _, tc := range []struct {
		base string
		n    int
		want string
	}{
		{"qemu-node-1", 1, "qemu-node-1"},
		{"qemu-node-1", 3, "qemu-node-1 qemu-node-2 qemu-node-3"},
		{"lab", 2, "lab-1 lab-2"},
		{"lab-x", 2, "lab-x-1 lab-x-2"},
		{"node7", 2, "node7-1 node7-2"},
	} {
		got, err := nodeNames(tc.base, tc.n)
		if err != nil || strings.Join(got, " ") != tc.want {
			t.Errorf("nodeNames(%q, %d) = %v, %v; want %s", tc.base, tc.n, got, err, tc.want)
		}
	}
	for _, n := range []int{0, -1, 21} {
		if _, err := nodeNames("qemu-node-1", n); err == nil || !strings.Contains(err.Error(), "want 1 to 20") {
			t.Errorf("nodeNames(_, %d): err %v, want a clear refusal", n, err)
		}
	}
}
