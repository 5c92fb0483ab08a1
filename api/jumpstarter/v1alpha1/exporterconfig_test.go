package v1alpha1_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"sigs.k8s.io/yaml"

	js "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
)

// TestExporterConfigYAML: the document the project writes has upstream's
// keys, exitOnLeaseEnd even when false, and reads back equal.
func TestExporterConfigYAML(t *testing.T) {
	c := js.ExporterConfig{
		APIVersion: js.GroupVersion.String(),
		Kind:       js.ExporterConfigKind,
		Metadata:   js.ExporterConfigMetadata{Name: "pool-x7k2p", Namespace: "lab"},
		Endpoint:   "grpc.jumpstarter.example:443",
		TLS:        &js.ExporterConfigTLS{CA: "LS0tLS1CRUdJTi0tLS0t"},
		Token:      "eyJhbGciOiJFUzI1NiJ9.e30.sig",
		Export: map[string]js.ExporterConfigDriver{
			"qemu":    {Type: "jumpstarter_driver_qemu.driver.Qemu", Config: &apiextv1.JSON{Raw: []byte(`{"smp":2}`)}},
			"console": {Ref: "qemu.console"},
		},
	}
	out, err := yaml.Marshal(c)
	require.NoError(t, err)
	assert.Equal(t, `apiVersion: jumpstarter.dev/v1alpha1
endpoint: grpc.jumpstarter.example:443
exitOnLeaseEnd: false
export:
  console:
    ref: qemu.console
  qemu:
    config:
      smp: 2
    type: jumpstarter_driver_qemu.driver.Qemu
kind: ExporterConfig
metadata:
  name: pool-x7k2p
  namespace: lab
tls:
  ca: LS0tLS1CRUdJTi0tLS0t
token: eyJhbGciOiJFUzI1NiJ9.e30.sig
`, string(out))
	back, err := js.ParseExporterConfig(out)
	require.NoError(t, err)
	assert.Equal(t, &c, back)
	assert.Equal(t, "exporter-config-pool-x7k2p", js.ExporterConfigSecretName("pool-x7k2p"))
}

// TestParseExporterConfig: keys the project does not use are ignored (as
// upstream's reader ignores them), apiVersion and kind may be left out, and
// each kind of bad document is refused with an error naming what and where.
func TestParseExporterConfig(t *testing.T) {
	c, err := js.ParseExporterConfig([]byte(`metadata: {name: e1}
endpoint: ctl:8082
token: t
exitOnLeaseEnd: true
hooks: {beforeLease: {script: "j power on"}}
export:
  composite:
    children:
      power: {type: jumpstarter_driver_power.driver.MockPower}
`))
	require.NoError(t, err)
	assert.True(t, c.ExitOnLeaseEnd)
	assert.Equal(t, "jumpstarter_driver_power.driver.MockPower", c.Export["composite"].Children["power"].Type)

	for name, tc := range map[string]struct{ doc, want string }{
		"not yaml":        {"metadata: [", "decode ExporterConfig"},
		"wrong group":     {"apiVersion: jumpstarter.dev/v1\nmetadata: {name: e}", `apiVersion "jumpstarter.dev/v1"`},
		"wrong kind":      {"kind: ClientConfig\nmetadata: {name: e}", `kind "ClientConfig"`},
		"no name":         {"metadata: {namespace: lab}", "metadata.name is empty"},
		"type and ref":    {"metadata: {name: e}\nexport: {a: {type: X, ref: b}}", "export.a: type and ref are mutually exclusive"},
		"ref with config": {"metadata: {name: e}\nexport: {a: {ref: b, config: {x: 1}}}", "export.a: a ref entry has no config"},
		"config, no type": {"metadata: {name: e}\nexport: {a: {children: {b: {config: {x: 1}}}}}", "export.a.children.b: config without a driver type"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := js.ParseExporterConfig([]byte(tc.doc))
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
}
