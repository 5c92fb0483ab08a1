package v1alpha1_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	vt "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

func readCRD(t *testing.T, name string) *apiextv1.CustomResourceDefinition {
	t.Helper()
	path := filepath.Join(testutil.VirtualTargetCRDs(testutil.MustRepoRoot(t)), name)
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	var c apiextv1.CustomResourceDefinition
	require.NoError(t, yaml.UnmarshalStrict(b, &c), path)
	require.Len(t, c.Spec.Versions, 1, path)
	return &c
}

func prop(t *testing.T, s apiextv1.JSONSchemaProps, path ...string) apiextv1.JSONSchemaProps {
	t.Helper()
	for _, p := range path {
		next, ok := s.Properties[p]
		require.True(t, ok, "no property %s in %v", p, path)
		s = next
	}
	return s
}

func enum(t *testing.T, s apiextv1.JSONSchemaProps) []string {
	t.Helper()
	var out []string
	for _, e := range s.Enum {
		var v string
		require.NoError(t, json.Unmarshal(e.Raw, &v))
		out = append(out, v)
	}
	return out
}

func def(s apiextv1.JSONSchemaProps) string {
	if s.Default == nil {
		return ""
	}
	return string(s.Default.Raw)
}

// TestExporterSetCRD checks the generated CRD (what the tests install)
// without upstream's beside the repository: the group and names exactly
// upstream's (no short name or category, which upstream's CRD does not
// declare), the scale subresource on spec.maxReplicas, the defaults the
// controller relies on, enums equal to the Go constants, and every status
// count required as upstream requires it.
func TestExporterSetCRD(t *testing.T) {
	c := readCRD(t, "virtualtarget.jumpstarter.dev_exportersets.yaml")
	assert.Equal(t, vt.GroupVersion.Group, c.Spec.Group)
	assert.Equal(t, apiextv1.NamespaceScoped, c.Spec.Scope)
	assert.Equal(t, apiextv1.CustomResourceDefinitionNames{Plural: "exportersets", Singular: "exporterset", Kind: "ExporterSet", ListKind: "ExporterSetList"}, c.Spec.Names)
	v := c.Spec.Versions[0]
	assert.Equal(t, vt.GroupVersion.Version, v.Name)
	require.NotNil(t, v.Subresources)
	assert.NotNil(t, v.Subresources.Status)
	assert.Equal(t, &apiextv1.CustomResourceSubresourceScale{
		SpecReplicasPath: ".spec.maxReplicas", StatusReplicasPath: ".status.replicas", LabelSelectorPath: ptr.To(".status.selector"),
	}, v.Subresources.Scale)

	root := *v.Schema.OpenAPIV3Schema
	spec := prop(t, root, "spec")
	assert.ElementsMatch(t, []string{"selector", "template", "virtualTargetClassName"}, spec.Required)
	assert.Equal(t, strconv.Itoa(int(vt.DefaultMaxReplicas)), def(prop(t, spec, "maxReplicas")), "the CRD's default is DefaultMaxReplicas")
	assert.Equal(t, "0", def(prop(t, spec, "minReplicas")))
	assert.Equal(t, "0", def(prop(t, spec, "minAvailableReplicas")))
	assert.Equal(t, `"5m"`, def(prop(t, spec, "scaleDownCooldown")))
	assert.Equal(t, `"`+string(vt.RecycleStrategyExitAndReplace)+`"`, def(prop(t, spec, "recycleStrategy")))
	assert.Equal(t, []string{string(vt.RecycleStrategyExitAndReplace), string(vt.RecycleStrategyInPlaceReuse)}, enum(t, prop(t, spec, "recycleStrategy")))
	assert.Equal(t, ptr.To(true), prop(t, spec, "parameters").XPreserveUnknownFields)
	drv := prop(t, spec, "template", "spec", "drivers").Items.Schema
	require.NotNil(t, drv)
	assert.Len(t, drv.XValidations, 4, "type/ref rules on each driver")

	status := prop(t, root, "status")
	assert.ElementsMatch(t, []string{
		"replicas", "readyReplicas", "availableReplicas", "unavailableReplicas", "leasedReplicas",
		"podsPending", "podsRunning", "podsFailed", "podsUnknown",
		"exportersActive", "exportersIdle", "exportersDisabled", "exportersOffline",
	}, status.Required)
	prop(t, status, "conditions")
	prop(t, status, "selector")
}

// TestVirtualTargetClassCRD: names exactly upstream's, provisioner
// required, defaults and enums equal to the Go constants.
func TestVirtualTargetClassCRD(t *testing.T) {
	c := readCRD(t, "virtualtarget.jumpstarter.dev_virtualtargetclasses.yaml")
	assert.Equal(t, vt.GroupVersion.Group, c.Spec.Group)
	assert.Equal(t, apiextv1.CustomResourceDefinitionNames{Plural: "virtualtargetclasses", Singular: "virtualtargetclass", Kind: "VirtualTargetClass", ListKind: "VirtualTargetClassList"}, c.Spec.Names)
	spec := prop(t, *c.Spec.Versions[0].Schema.OpenAPIV3Schema, "spec")
	assert.Equal(t, []string{"provisioner"}, spec.Required)
	assert.Equal(t, `"`+string(vt.BindingModeImmediate)+`"`, def(prop(t, spec, "bindingMode")))
	assert.Equal(t, []string{string(vt.BindingModeImmediate), string(vt.BindingModeWaitForFirstConsumer)}, enum(t, prop(t, spec, "bindingMode")))
	assert.Equal(t, `"`+string(vt.ReclaimPolicyDelete)+`"`, def(prop(t, spec, "reclaimPolicy")))
	assert.Equal(t, []string{string(vt.ReclaimPolicyDelete), string(vt.ReclaimPolicyRetain)}, enum(t, prop(t, spec, "reclaimPolicy")))
	assert.Equal(t, `"ca-bundle.crt"`, def(prop(t, spec, "caBundleConfigMapRef", "key")))
}

// TestExporterSetRoundTrip decodes a set as an admin writes it and encodes
// it again: maxReplicas 0 (no ceiling) survives, parameters and driver
// config stay as written.
func TestExporterSetRoundTrip(t *testing.T) {
	const in = `apiVersion: virtualtarget.jumpstarter.dev/v1alpha1
kind: ExporterSet
metadata:
  name: qemu-pool
  namespace: lab
spec:
  virtualTargetClassName: vm
  maxReplicas: 0
  minAvailableReplicas: 1
  recycleStrategy: InPlaceReuse
  scaleDownCooldown: 90s
  parameters:
    arch: aarch64
    resources: {cpu: "2", memory: 2Gi, storage: 8Gi}
  selector:
    matchLabels: {pool: qemu}
  template:
    metadata:
      labels: {pool: qemu}
    spec:
      drivers:
      - name: qemu
        type: jumpstarter_driver_qemu.driver.Qemu
        config: {smp: 2, hostfwd: {ssh: {hostfwd_port: 2222}}}
      - name: console
        ref: qemu.console
`
	var es vt.ExporterSet
	require.NoError(t, yaml.UnmarshalStrict([]byte(in), &es))
	n, bounded := es.Spec.Ceiling()
	assert.Equal(t, int32(0), n)
	assert.False(t, bounded, "maxReplicas 0 means no ceiling")
	assert.Equal(t, vt.RecycleStrategyInPlaceReuse, es.Spec.RecycleStrategy)
	assert.Equal(t, "1m30s", es.Spec.ScaleDownCooldown.Duration.String())
	require.Len(t, es.Spec.Template.Spec.Drivers, 2)
	assert.Equal(t, "qemu.console", es.Spec.Template.Spec.Drivers[1].Ref)

	out, err := yaml.Marshal(&es)
	require.NoError(t, err)
	var back map[string]any
	require.NoError(t, yaml.Unmarshal(out, &back))
	spec := back["spec"].(map[string]any)
	assert.Equal(t, float64(0), spec["maxReplicas"], "an explicit 0 is written, not dropped for the default 4")
	assert.Equal(t, map[string]any{"arch": "aarch64", "resources": map[string]any{"cpu": "2", "memory": "2Gi", "storage": "8Gi"}}, spec["parameters"])
	drivers := spec["template"].(map[string]any)["spec"].(map[string]any)["drivers"].([]any)
	assert.Equal(t, map[string]any{"smp": float64(2), "hostfwd": map[string]any{"ssh": map[string]any{"hostfwd_port": float64(2222)}}}, drivers[0].(map[string]any)["config"])
}

func TestCeiling(t *testing.T) {
	for _, tc := range []struct {
		max     *int32
		want    int32
		bounded bool
	}{
		{nil, vt.DefaultMaxReplicas, true},
		{ptr.To[int32](0), 0, false},
		{ptr.To[int32](7), 7, true},
	} {
		s := vt.ExporterSetSpec{MaxReplicas: tc.max}
		n, bounded := s.Ceiling()
		assert.Equal(t, tc.want, n)
		assert.Equal(t, tc.bounded, bounded)
	}
}
