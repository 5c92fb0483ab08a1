package charts

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
)

const (
	chartDir    = "qemu-kubelet"
	releaseName = "t"
	releaseNS   = "qk"
)

// buildHelm runs hack/build-helm.sh once per test binary (cached by version
// outside the repository, so usually instant).
var buildHelm = sync.OnceValues(func() (string, error) {
	root, err := cluster.RepoRoot()
	if err != nil {
		return "", err
	}
	cmd := exec.Command(filepath.Join(root, "hack", "build-helm.sh"))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("hack/build-helm.sh: %w\n%s", err, stderr.String())
	}
	return strings.TrimSpace(string(out)), nil
})

func helmBin(t *testing.T) string {
	t.Helper()
	bin, err := buildHelm()
	require.NoError(t, err)
	return bin
}

// runHelm runs helm in this directory (charts/) with an isolated home.
func runHelm(t *testing.T, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	cmd := exec.Command(helmBin(t), args...)
	home := t.TempDir()
	cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+home+"/cache", "HELM_CONFIG_HOME="+home+"/config", "HELM_DATA_HOME="+home+"/data")
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	err = cmd.Run()
	return o.String(), e.String(), err
}

// ciValues lists the ci/*.yaml values files (the chart's test matrix).
func ciValues(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(chartDir, "ci", "*.yaml"))
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(files), 5, "ci values files")
	return files
}

// templateArgs are the arguments of `helm template` for a values file.
func templateArgs(valuesFile string, set ...string) []string {
	args := []string{"template", releaseName, chartDir, "--namespace", releaseNS}
	if valuesFile != "" {
		args = append(args, "-f", valuesFile)
	}
	for _, s := range set {
		args = append(args, "--set", s)
	}
	return args
}

// render runs helm template and returns the raw YAML.
func render(t *testing.T, valuesFile string, set ...string) string {
	t.Helper()
	out, stderr, err := runHelm(t, templateArgs(valuesFile, set...)...)
	require.NoError(t, err, "helm template %s: %s", valuesFile, stderr)
	return out
}

// objects parses a multi-document YAML stream.
func objects(t *testing.T, manifest string) []unstructured.Unstructured {
	t.Helper()
	dec := utilyaml.NewYAMLOrJSONDecoder(strings.NewReader(manifest), 4096)
	var objs []unstructured.Unstructured
	for {
		var m map[string]any
		err := dec.Decode(&m)
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err, "decode rendered manifest")
		if m == nil {
			continue
		}
		objs = append(objs, unstructured.Unstructured{Object: m})
	}
	return objs
}

func kinds(objs []unstructured.Unstructured) map[string]int {
	k := map[string]int{}
	for _, o := range objs {
		k[o.GetKind()]++
	}
	return k
}

// one returns the single object of kind, converted to T.
func one[T any](t *testing.T, objs []unstructured.Unstructured, kind string) *T {
	t.Helper()
	var found []unstructured.Unstructured
	for _, o := range objs {
		if o.GetKind() == kind {
			found = append(found, o)
		}
	}
	require.Len(t, found, 1, "objects of kind %s", kind)
	v := new(T)
	if u, ok := any(v).(*unstructured.Unstructured); ok {
		*u = found[0]
		return v
	}
	require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructuredWithValidation(found[0].Object, v, true), "convert %s", kind)
	return v
}

// nodeConfig returns the NodeConfiguration the chart writes into the node
// agent's ConfigMap.
func nodeConfig(t *testing.T, objs []unstructured.Unstructured) (raw string, cfg map[string]any) {
	t.Helper()
	cm := one[corev1.ConfigMap](t, filter(objs, "ConfigMap", releaseName+"-qemu-kubelet-node-config"), "ConfigMap")
	raw = cm.Data["config.yaml"]
	require.NoError(t, yaml.Unmarshal([]byte(raw), &cfg), "config.yaml of %s", cm.Name)
	return raw, cfg
}

func TestCRDsMatchConfig(t *testing.T) {
	root, err := cluster.RepoRoot()
	require.NoError(t, err)
	src, err := filepath.Glob(filepath.Join(root, "config", "crd", "*.yaml"))
	require.NoError(t, err)
	require.NotEmpty(t, src, "config/crd has no CRDs")
	dst, err := filepath.Glob(filepath.Join(chartDir, "crds", "*.yaml"))
	require.NoError(t, err)
	base := func(ps []string) []string {
		var b []string
		for _, p := range ps {
			b = append(b, filepath.Base(p))
		}
		sort.Strings(b)
		return b
	}
	require.Equal(t, base(src), base(dst), "chart CRDs differ from config/crd: run hack/sync-chart-crds.sh")
	for _, s := range src {
		want, err := os.ReadFile(s)
		require.NoError(t, err)
		got, err := os.ReadFile(filepath.Join(chartDir, "crds", filepath.Base(s)))
		require.NoError(t, err)
		require.True(t, bytes.Equal(want, got), "%s differs from config/crd: run hack/sync-chart-crds.sh", filepath.Base(s))
	}
}

func TestLint(t *testing.T) {
	cases := append([]string{""}, ciValues(t)...)
	for _, f := range cases {
		name := "defaults"
		if f != "" {
			name = filepath.Base(f)
		}
		t.Run(name, func(t *testing.T) {
			args := []string{"lint", "--strict", chartDir}
			if f != "" {
				args = append(args, "-f", f)
			}
			out, stderr, err := runHelm(t, args...)
			require.NoError(t, err, "helm lint:\n%s%s", out, stderr)
			assert.Contains(t, out, "0 chart(s) failed")
			assert.NotContains(t, out, "[WARNING]")
			assert.NotContains(t, out, "[ERROR]")
		})
	}
}

// TestTemplate checks what each values file renders.
func TestTemplate(t *testing.T) {
	type check func(t *testing.T, objs []unstructured.Unstructured)
	cases := []struct {
		values  string
		present []string
		absent  []string
		check   check
	}{
		{
			values:  "",
			present: []string{"Deployment", "DaemonSet", "ConfigMap", "RuntimeClass", "Service", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ServiceAccount"},
			absent:  []string{"ServiceMonitor", "PodMonitor", "CustomResourceDefinition", "Namespace"},
			check: func(t *testing.T, objs []unstructured.Unstructured) {
				ds := one[appsv1.DaemonSet](t, objs, "DaemonSet")
				spec := ds.Spec.Template.Spec
				assert.Equal(t, map[string]string{"qemu-kubelet.io/kvm-host": "true"}, spec.NodeSelector)
				vol := volume(t, spec.Volumes, "kvm")
				require.NotNil(t, vol.HostPath, "kvm volume is a hostPath")
				assert.Equal(t, "/dev/kvm", vol.HostPath.Path)
				assert.Equal(t, corev1.HostPathCharDev, *vol.HostPath.Type)
				c := spec.Containers[0]
				assert.Contains(t, mounts(c), "/dev/kvm")
				assert.True(t, *c.SecurityContext.Privileged, "hostPath /dev/kvm needs a privileged container")
				state := volume(t, spec.Volumes, "state")
				assert.Equal(t, "/var/lib/qemu-kubelet", state.HostPath.Path)
				assert.Equal(t, corev1.HostPathDirectoryOrCreate, *state.HostPath.Type)
				assert.Contains(t, mounts(c), "/var/lib/qemu-kubelet")
				assert.Contains(t, c.Args, "--config=/etc/qemu-kubelet/config.yaml")
				assert.Contains(t, c.Args, "--node-name=qemu-$(HOST_NODE_NAME)")
				assert.Equal(t, "spec.nodeName", c.Env[0].ValueFrom.FieldRef.FieldPath)
				assert.NotContains(t, strings.Join(c.Args, " "), "--metrics-bind-address")

				// keepVMs (default): VMs outlive the container.
				assert.True(t, spec.HostPID, "QEMU in the host's PID namespace outlives the container")
				assert.Equal(t, "1Gi", c.Resources.Limits.Memory().String(), "the agent's own memory is bounded (nodeAgent.memoryLimit)")
				cg := volume(t, spec.Volumes, "cgroup")
				require.NotNil(t, cg.HostPath)
				assert.Equal(t, "/sys/fs/cgroup", cg.HostPath.Path)
				assert.Contains(t, mounts(c), "/sys/fs/cgroup")
				assert.Contains(t, c.Args, "--stop-vms-unless-owner-exists")
				envs := map[string]string{}
				for _, e := range c.Env {
					if e.ValueFrom != nil && e.ValueFrom.FieldRef != nil {
						envs[e.Name] = e.ValueFrom.FieldRef.FieldPath
					}
				}
				assert.Equal(t, "metadata.name", envs["POD_NAME"])
				assert.Equal(t, "metadata.namespace", envs["POD_NAMESPACE"])
				owner := one[rbacv1.Role](t, filter(objs, "Role", "t-qemu-kubelet-node-owner"), "Role")
				assert.Equal(t, releaseNS, owner.Namespace)
				assert.True(t, grants(owner.Rules, "apps", "daemonsets", "watch"), "the agent watches its DaemonSet")
				assert.False(t, grants(owner.Rules, "apps", "daemonsets", "delete"))

				_, cfg := nodeConfig(t, objs)
				assert.Equal(t, map[string]any{"mode": "Own", "root": "/sys/fs/cgroup", "parent": "qemu-kubelet", "namespace": "/proc/1/ns/cgroup"}, cfg["vmCgroup"])
				assert.Equal(t, "qemu-kubelet.io/v1alpha1", cfg["apiVersion"])
				assert.Equal(t, "NodeConfiguration", cfg["kind"])
				assert.Equal(t, "/var/lib/qemu-kubelet", cfg["stateDir"])
				assert.NotContains(t, cfg, "taints", "default taint comes from the agent")
				assert.Equal(t, "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt", cfg["server"].(map[string]any)["clientCAFile"],
					"kubectl logs through the API server authenticate with the cluster CA by default")

				rc := one[nodev1.RuntimeClass](t, objs, "RuntimeClass")
				assert.Equal(t, "qemu", rc.Name)
				assert.Equal(t, "qemu", rc.Handler)
				require.NotNil(t, rc.Overhead)
				assert.Equal(t, "128Mi", ptrStr(rc.Overhead.PodFixed.Memory()))
				assert.Equal(t, "100m", ptrStr(rc.Overhead.PodFixed.Cpu()))
				require.NotNil(t, rc.Scheduling)
				assert.Equal(t, map[string]string{"type": "virtual-kubelet"}, rc.Scheduling.NodeSelector)
				assert.Contains(t, rc.Scheduling.Tolerations, corev1.Toleration{Key: "virtual-kubelet.io/provider", Operator: corev1.TolerationOpEqual, Value: "qemu", Effect: corev1.TaintEffectNoSchedule})

				dep := one[appsv1.Deployment](t, objs, "Deployment")
				assert.Equal(t, int32(1), *dep.Spec.Replicas)
				cc := dep.Spec.Template.Spec.Containers[0]
				assert.Contains(t, cc.Args, "--leader-elect=true")
				assert.Contains(t, cc.Args, "--metrics-bind-address=:8080")
				assert.Contains(t, cc.Args, "--health-probe-bind-address=:8081")
				assert.True(t, *dep.Spec.Template.Spec.SecurityContext.RunAsNonRoot)
				assert.True(t, *cc.SecurityContext.ReadOnlyRootFilesystem)
				assert.Equal(t, "/healthz", cc.LivenessProbe.HTTPGet.Path)
				assert.Equal(t, "/readyz", cc.ReadinessProbe.HTTPGet.Path)
				assert.ElementsMatch(t, []string{"metrics", "health"}, portNames(cc.Ports))

				agent := rulesOf(t, objs, "ClusterRole", "t-qemu-kubelet-node")
				assert.True(t, grants(agent, "", "secrets", "get"), "agent reads its pods' pull secrets by name")
				assert.False(t, grants(agent, "", "secrets", "list"), "agent lists no secrets by default")
				assert.False(t, grants(agent, "", "secrets", "watch"), "agent watches no secrets by default")
				assert.False(t, grants(agent, "", "configmaps", "get"), "agent reads no config maps by default")
				assert.False(t, grants(agent, "", "nodes", "delete"), "agent deletes no nodes")
				for _, want := range [][3]string{
					{"", "nodes", "create"}, {"", "nodes/status", "patch"}, {"", "pods", "watch"},
					{"", "pods/status", "patch"}, {"", "events", "create"},
					{"authentication.k8s.io", "tokenreviews", "create"},
					{"authorization.k8s.io", "subjectaccessreviews", "create"},
				} {
					assert.True(t, grants(agent, want[0], want[1], want[2]), "agent needs %v", want)
				}
				lease := one[rbacv1.Role](t, filter(objs, "Role", "t-qemu-kubelet-node-lease"), "Role")
				assert.Equal(t, "kube-node-lease", lease.Namespace)
				assert.True(t, grants(lease.Rules, "coordination.k8s.io", "leases", "update"))
			},
		},
		{
			values:  chartDir + "/ci/monitoring-values.yaml",
			present: []string{"ServiceMonitor", "PodMonitor", "DaemonSet", "Deployment"},
			check: func(t *testing.T, objs []unstructured.Unstructured) {
				ds := one[appsv1.DaemonSet](t, objs, "DaemonSet")
				c := ds.Spec.Template.Spec.Containers[0]
				assert.Contains(t, c.Args, "--metrics-bind-address=:10255")
				assert.Contains(t, portNames(c.Ports), "metrics")
				sm := one[unstructured.Unstructured](t, objs, "ServiceMonitor")
				assert.Equal(t, "prometheus", sm.GetLabels()["release"])
				eps, _, _ := unstructured.NestedSlice(sm.Object, "spec", "endpoints")
				require.Len(t, eps, 1)
				assert.Equal(t, true, eps[0].(map[string]any)["honorLabels"], "the gauges keep their own namespace label")
				sel, _, _ := unstructured.NestedStringMap(sm.Object, "spec", "selector", "matchLabels")
				svc := one[corev1.Service](t, objs, "Service")
				for k, v := range sel {
					assert.Equal(t, v, svc.Labels[k], "ServiceMonitor selects the metrics Service (label %s)", k)
				}
				pm := one[unstructured.Unstructured](t, objs, "PodMonitor")
				psel, _, _ := unstructured.NestedStringMap(pm.Object, "spec", "selector", "matchLabels")
				assert.Equal(t, ds.Spec.Selector.MatchLabels, psel, "PodMonitor selects the node agents")
			},
		},
		{
			values:  chartDir + "/ci/controller-only-values.yaml",
			present: []string{"Deployment", "Role", "RoleBinding", "Service"},
			absent:  []string{"DaemonSet", "ConfigMap", "RuntimeClass", "ClusterRole", "ClusterRoleBinding", "ServiceMonitor", "PodMonitor"},
			check: func(t *testing.T, objs []unstructured.Unstructured) {
				dep := one[appsv1.Deployment](t, objs, "Deployment")
				assert.Equal(t, int32(2), *dep.Spec.Replicas)
				args := dep.Spec.Template.Spec.Containers[0].Args
				assert.Contains(t, args, "--leader-elect=true")
				assert.Contains(t, args, "--leader-election-namespace="+releaseNS)
				assert.Contains(t, args, "--namespace=labs")
				r := one[rbacv1.Role](t, filter(objs, "Role", "t-qemu-kubelet-controller"), "Role")
				assert.Equal(t, "labs", r.Namespace, "watchNamespace narrows the controller's RBAC to a Role there")
				assert.True(t, grants(r.Rules, "", "pods", "create"))
				le := one[rbacv1.Role](t, filter(objs, "Role", "t-qemu-kubelet-controller-leader-election"), "Role")
				assert.Equal(t, releaseNS, le.Namespace)
			},
		},
		{
			values:  chartDir + "/ci/node-agent-only-values.yaml",
			present: []string{"DaemonSet", "ConfigMap", "RuntimeClass", "ClusterRole"},
			absent:  []string{"Deployment", "Service", "ServiceMonitor", "PodMonitor"},
			check: func(t *testing.T, objs []unstructured.Unstructured) {
				ds := one[appsv1.DaemonSet](t, objs, "DaemonSet")
				spec := ds.Spec.Template.Spec
				assert.Equal(t, map[string]string{"example.com/kvm": "yes"}, spec.NodeSelector)
				c := spec.Containers[0]
				assert.NotContains(t, mounts(c), "/dev/kvm", "device plugin mode mounts no hostPath /dev/kvm")
				for _, v := range spec.Volumes {
					assert.NotEqual(t, "kvm", v.Name)
				}
				assert.Nil(t, c.SecurityContext.Privileged, "device plugin mode is unprivileged")
				assert.Equal(t, int64(0), *c.SecurityContext.RunAsUser, "the agent owns the host state dir")
				assert.Equal(t, []corev1.Capability{"ALL"}, c.SecurityContext.Capabilities.Drop)
				assert.Equal(t, []corev1.Capability{"SYS_ADMIN", "SYS_PTRACE", "DAC_OVERRIDE", "SETPCAP", "SETUID", "SETGID", "CHOWN", "KILL", "SYS_NICE"}, c.SecurityContext.Capabilities.Add,
					"keepVMs: QEMU is started in the host's cgroup namespace; vmUser: as uid 107")
				_, cfg := nodeConfig(t, objs)
				assert.Equal(t, map[string]any{"uid": float64(107), "gid": float64(107)}, cfg["vmUser"], "QEMU runs as KubeVirt's qemu uid by default")
				assert.True(t, spec.HostPID)
				assert.False(t, *c.SecurityContext.AllowPrivilegeEscalation)
				q := c.Resources.Limits[corev1.ResourceName("devices.kubevirt.io/kvm")]
				assert.Equal(t, "1", q.String(), "requests one KVM device")
				agent := rulesOf(t, objs, "ClusterRole", "t-qemu-kubelet-node")
				assert.True(t, grants(agent, "", "secrets", "list"), "readPodReferencedObjects grants secret reads")
				assert.True(t, grants(agent, "", "configmaps", "watch"), "readPodReferencedObjects grants config map reads")
				assert.False(t, grants(agent, "", "secrets", "create"))
			},
		},
		{
			values:  chartDir + "/ci/custom-taints-values.yaml",
			present: []string{"DaemonSet", "RuntimeClass"},
			check: func(t *testing.T, objs []unstructured.Unstructured) {
				_, cfg := nodeConfig(t, objs)
				assert.Equal(t, []any{
					map[string]any{"key": "example.com/vm-host", "value": "lab", "effect": "NoSchedule"},
					map[string]any{"key": "example.com/dedicated", "effect": "NoExecute"},
				}, cfg["taints"])
				assert.Equal(t, "/srv/qemu-kubelet", cfg["stateDir"])
				assert.Equal(t, float64(4), cfg["maxVMs"])
				rc := one[nodev1.RuntimeClass](t, objs, "RuntimeClass")
				assert.Equal(t, "qemu-lab", rc.Name)
				assert.Len(t, rc.Scheduling.Tolerations, 2)
				assert.Equal(t, "lab", rc.Scheduling.NodeSelector["example.com/pool"])
				ds := one[appsv1.DaemonSet](t, objs, "DaemonSet")
				assert.Contains(t, ds.Spec.Template.Spec.Containers[0].Args, "--node-name=vm-$(HOST_NODE_NAME)")
				assert.Equal(t, "/srv/qemu-kubelet", volume(t, ds.Spec.Template.Spec.Volumes, "state").HostPath.Path)
				assert.Equal(t, "kubelet-client-ca", volume(t, ds.Spec.Template.Spec.Volumes, "kubelet-client-ca").ConfigMap.Name)
				assert.Contains(t, mounts(ds.Spec.Template.Spec.Containers[0]), "/etc/kubelet-client-ca")
				server := cfg["server"].(map[string]any)
				assert.Equal(t, "/etc/kubelet-client-ca/ca.crt", server["clientCAFile"])
				assert.Equal(t, float64(10250), server["port"], "values merge: the default port stays")
				// keepVMs disabled: VMs live in the agent's container.
				spec := ds.Spec.Template.Spec
				assert.False(t, spec.HostPID)
				assert.True(t, spec.Containers[0].Resources.Limits.Memory().IsZero(), "no memory limit over the VMs' QEMUs")
				for _, v := range spec.Volumes {
					assert.NotEqual(t, "cgroup", v.Name)
				}
				assert.NotContains(t, spec.Containers[0].Args, "--stop-vms-unless-owner-exists")
				assert.NotContains(t, cfg, "vmCgroup")
				assert.Empty(t, filter(objs, "Role", "t-qemu-kubelet-node-owner"))
			},
		},
	}
	// Every ci values file has a case.
	var covered []string
	for _, c := range cases {
		covered = append(covered, c.values)
	}
	for _, f := range ciValues(t) {
		if filepath.Base(f) != "default-values.yaml" {
			assert.Contains(t, covered, f, "TestTemplate has no case for %s", f)
		}
	}
	for _, c := range cases {
		name := c.values
		if name == "" {
			name = "defaults"
		}
		t.Run(filepath.Base(name), func(t *testing.T) {
			objs := objects(t, render(t, c.values))
			k := kinds(objs)
			for _, p := range c.present {
				assert.Positive(t, k[p], "kind %s rendered", p)
			}
			for _, a := range c.absent {
				assert.Zero(t, k[a], "kind %s not rendered", a)
			}
			if c.check != nil {
				c.check(t, objs)
			}
		})
	}
}

// TestRBACLeastPrivilege: no wildcard anywhere, no escalation verbs, with
// every values file.
func TestRBACLeastPrivilege(t *testing.T) {
	for _, f := range append([]string{""}, ciValues(t)...) {
		t.Run(caseName(f), func(t *testing.T) {
			objs := objects(t, render(t, f))
			n := 0
			for _, o := range objs {
				if o.GetKind() != "ClusterRole" && o.GetKind() != "Role" {
					continue
				}
				n++
				rules, _, _ := unstructured.NestedSlice(o.Object, "rules")
				require.NotEmpty(t, rules, "%s %s has rules", o.GetKind(), o.GetName())
				for _, r := range rules {
					rm := r.(map[string]any)
					for _, field := range []string{"apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"} {
						vals, _, _ := unstructured.NestedStringSlice(rm, field)
						for _, v := range vals {
							assert.NotContains(t, v, "*", "%s %s: wildcard in %s", o.GetKind(), o.GetName(), field)
							if field == "verbs" {
								assert.NotContains(t, []string{"escalate", "bind", "impersonate", "deletecollection"}, v, "%s %s", o.GetKind(), o.GetName())
							}
						}
					}
				}
				agg, _, _ := unstructured.NestedFieldNoCopy(o.Object, "aggregationRule")
				assert.Nil(t, agg, "no aggregated roles")
			}
			assert.Positive(t, n, "some RBAC is rendered")
		})
	}
}

// TestBadValuesRejected: helm template (and, for schema errors, helm lint)
// fails, naming the field. Cross-field rules live in the schema and again in
// templates/validate.yaml, which still guards --skip-schema-validation.
func TestBadValuesRejected(t *testing.T) {
	cases := []struct {
		file, want string
		// noSchema: the message without schema validation (template fail).
		noSchema string
		// lint: helm lint fails too (it reports template fail() calls as
		// INFO only, so only schema errors fail it).
		lint bool
	}{
		{file: "bad-kvm-mode.yaml", want: "/nodeAgent/kvm/mode", lint: true},
		{file: "bad-replicas-type.yaml", want: "/controller/replicas", lint: true},
		{file: "bad-unknown-key.yaml", want: "'hostLabels' not allowed", lint: true},
		{file: "bad-taint-effect.yaml", want: "/nodeAgent/config/taints/0/effect", lint: true},
		{file: "bad-accelerator.yaml", want: "/nodeAgent/config/accelerator/policy", lint: true},
		{file: "bad-state-dir.yaml", want: "/nodeAgent/stateDir", lint: true},
		{file: "bad-leader-election.yaml", want: "/controller/leaderElection/enabled", lint: true,
			noSchema: "more than one replica needs controller.leaderElection.enabled=true"},
		{file: "bad-podmonitor.yaml", want: "/nodeAgent/metrics/enabled", lint: true,
			noSchema: "it needs nodeAgent.enabled=true and nodeAgent.metrics.enabled=true"},
		{file: "bad-config-statedir.yaml", want: "nodeAgent.config.stateDir: set nodeAgent.stateDir instead"},
		{file: "bad-config-vmcgroup.yaml", want: "nodeAgent.config.vmCgroup: set nodeAgent.keepVMs instead"},
		{file: "bad-keepvms-parent.yaml", want: "/nodeAgent/keepVMs/cgroupParent", lint: true},
		{file: "bad-config-vmuser.yaml", want: "nodeAgent.config.vmUser: set nodeAgent.vmUser instead"},
		{file: "bad-vmuser-uid.yaml", want: "/nodeAgent/vmUser/uid", lint: true},
	}
	files, err := filepath.Glob(filepath.Join("testdata", "bad", "*.yaml"))
	require.NoError(t, err)
	require.Len(t, files, len(cases), "every testdata/bad file has a case")
	for _, c := range cases {
		t.Run(c.file, func(t *testing.T) {
			f := filepath.Join("testdata", "bad", c.file)
			out, stderr, err := runHelm(t, templateArgs(f)...)
			require.Error(t, err, "helm template accepted %s:\n%s", c.file, out)
			assert.Contains(t, stderr, c.want)
			if c.noSchema != "" {
				_, stderr, err := runHelm(t, append(templateArgs(f), "--skip-schema-validation")...)
				require.Error(t, err, "helm template --skip-schema-validation accepted %s", c.file)
				assert.Contains(t, stderr, c.noSchema)
			}
			if c.lint {
				lout, lerr, err := runHelm(t, "lint", chartDir, "-f", f)
				require.Error(t, err, "helm lint accepted %s", c.file)
				assert.Contains(t, lout+lerr, c.want)
				assert.Contains(t, lerr, "1 chart(s) failed")
			}
		})
	}
}

func volume(t *testing.T, vs []corev1.Volume, name string) corev1.Volume {
	t.Helper()
	for _, v := range vs {
		if v.Name == name {
			return v
		}
	}
	t.Fatalf("no volume %q", name)
	return corev1.Volume{}
}

func mounts(c corev1.Container) []string {
	var m []string
	for _, v := range c.VolumeMounts {
		m = append(m, v.MountPath)
	}
	return m
}

func portNames(ps []corev1.ContainerPort) []string {
	var n []string
	for _, p := range ps {
		n = append(n, p.Name)
	}
	return n
}

func filter(objs []unstructured.Unstructured, kind, name string) []unstructured.Unstructured {
	var out []unstructured.Unstructured
	for _, o := range objs {
		if o.GetKind() == kind && o.GetName() == name {
			out = append(out, o)
		}
	}
	return out
}

func rulesOf(t *testing.T, objs []unstructured.Unstructured, kind, name string) []rbacv1.PolicyRule {
	t.Helper()
	return one[rbacv1.ClusterRole](t, filter(objs, kind, name), kind).Rules
}

// grants reports whether rules allow verb on group/resource.
func grants(rules []rbacv1.PolicyRule, group, resource, verb string) bool {
	for _, r := range rules {
		if slices.Contains(r.APIGroups, group) && slices.Contains(r.Resources, resource) && slices.Contains(r.Verbs, verb) {
			return true
		}
	}
	return false
}

func ptrStr(q interface{ String() string }) string { return q.String() }

// TestNodeConfigAccepted: the NodeConfiguration the chart renders from each
// values file passes the agent's own strict loader and validation.
func TestNodeConfigAccepted(t *testing.T) {
	for _, f := range append([]string{""}, ciValues(t)...) {
		t.Run(caseName(f), func(t *testing.T) {
			objs := objects(t, render(t, f))
			if kinds(objs)["DaemonSet"] == 0 {
				assert.Zero(t, kinds(objs)["ConfigMap"], "no node config without node agents")
				return
			}
			raw, _ := nodeConfig(t, objs)
			path := filepath.Join(t.TempDir(), "config.yaml")
			require.NoError(t, os.WriteFile(path, []byte(raw), 0o600))
			file, err := config.Load(path)
			require.NoError(t, err, "rendered config:\n%s", raw)
			file.NodeName = "qemu-host1" // --node-name
			_, err = config.Resolve(file, config.Environment{Hostname: "host1", HostIP: "192.0.2.1"})
			require.NoError(t, err, "rendered config:\n%s", raw)
		})
	}
}

// TestSchemaKnowsNodeConfiguration: nodeAgent.config in values.schema.json
// accepts exactly the fields of config.NodeConfiguration (recursively), so
// a new config field is settable through the chart and a misspelt one is
// not.
func TestSchemaKnowsNodeConfiguration(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(chartDir, "values.schema.json"))
	require.NoError(t, err)
	var schema map[string]any
	require.NoError(t, json.Unmarshal(b, &schema))
	node, _, _ := unstructured.NestedMap(schema, "properties", "nodeAgent", "properties", "config")
	require.NotNil(t, node)
	var walk func(path string, typ reflect.Type, s map[string]any)
	walk = func(path string, typ reflect.Type, s map[string]any) {
		assert.Equal(t, false, s["additionalProperties"], "%s: unknown fields are rejected", path)
		props, _ := s["properties"].(map[string]any)
		fields := map[string]reflect.StructField{}
		for i := 0; i < typ.NumField(); i++ {
			f := typ.Field(i)
			name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
			if name == "" || name == "-" || name == "apiVersion" || name == "kind" {
				continue // apiVersion/kind are set by the chart
			}
			fields[name] = f
			p, ok := props[name].(map[string]any)
			if !assert.True(t, ok, "%s.%s (config.NodeConfiguration) is missing from values.schema.json", path, name) {
				continue
			}
			ft := f.Type
			for ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if ft.Kind() == reflect.Struct && p["properties"] != nil {
				walk(path+"."+name, ft, p)
			}
		}
		for name := range props {
			_, ok := fields[name]
			assert.True(t, ok, "values.schema.json %s.%s is not a field of config.NodeConfiguration", path, name)
		}
	}
	walk("nodeAgent.config", reflect.TypeOf(config.NodeConfiguration{}), node)
}

// TestValuesDocumented: every value of values.yaml has a row in the values
// table of docs/install.md (as `full.path`, or `parent.x`, `.leaf` in one row).
func TestValuesDocumented(t *testing.T) {
	root, err := cluster.RepoRoot()
	require.NoError(t, err)
	doc, err := os.ReadFile(filepath.Join(root, "docs", "install.md"))
	require.NoError(t, err)
	var rows []string
	for _, l := range strings.Split(string(doc), "\n") {
		if strings.HasPrefix(l, "| `") {
			rows = append(rows, l)
		}
	}
	require.NotEmpty(t, rows, "values table in docs/install.md")
	b, err := os.ReadFile(filepath.Join(chartDir, "values.yaml"))
	require.NoError(t, err)
	var values map[string]any
	require.NoError(t, yaml.Unmarshal(b, &values))
	// Free-form maps are documented as a whole.
	whole := map[string]bool{"resources": true, "podSecurityContext": true, "securityContext": true, "nodeSelector": true,
		"tolerations": true, "affinity": true, "config": true, "overhead": true, "labels": true, "annotations": true,
		"podAnnotations": true, "podLabels": true, "updateStrategy": true, "commonLabels": true}
	var paths []string
	var walk func(prefix string, m map[string]any)
	walk = func(prefix string, m map[string]any) {
		for k, v := range m {
			p := strings.TrimPrefix(prefix+"."+k, ".")
			if sub, ok := v.(map[string]any); ok && len(sub) > 0 && !whole[k] {
				walk(p, sub)
				continue
			}
			paths = append(paths, p)
		}
	}
	walk("", values)
	require.Greater(t, len(paths), 40)
	for _, p := range paths {
		parent, leaf := "", p
		if i := strings.LastIndex(p, "."); i >= 0 {
			parent, leaf = p[:i], p[i+1:]
		}
		found := false
		for _, r := range rows {
			cell, _, _ := strings.Cut(strings.TrimPrefix(r, "| "), " |")
			if strings.Contains(cell, "`"+p+"`") || parent != "" && strings.Contains(cell, "`"+parent+".") && strings.Contains(cell, "`."+leaf+"`") {
				found = true
				break
			}
		}
		assert.True(t, found, "value %s is not in the values table of docs/install.md", p)
	}
}
