package controller

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	vtv1 "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
)

// TestUpstreamExporterConfig: the config.yaml of an upstream set's
// exporter Secret is upstream's ExporterConfig document: its keys, the CA
// base64 encoded, the template's drivers by name (type and config, or a
// ref), exitOnLeaseEnd unless InPlaceReuse; a driver name given twice is
// an error naming it.
func TestUpstreamExporterConfig(t *testing.T) {
	set := vtSetWithDrivers(
		vtv1.DriverConfig{Name: "qemu", Type: "jumpstarter_driver_qemu.driver.Qemu", Config: &apiextv1.JSON{Raw: []byte(`{"smp":2}`)}},
		vtv1.DriverConfig{Name: "power", Type: "jumpstarter_driver_power.driver.QemuPower"},
		vtv1.DriverConfig{Name: "serial", Ref: "qemu.console"},
	)
	out, err := upstreamExporterConfig(set, false, "-----BEGIN CERTIFICATE-----\n", "lab", "pool-x7k2p", "grpc.example:443", []byte("tok-1\n"))
	require.NoError(t, err)
	assert.Equal(t, `apiVersion: jumpstarter.dev/v1alpha1
endpoint: grpc.example:443
exitOnLeaseEnd: true
export:
  power:
    type: jumpstarter_driver_power.driver.QemuPower
  qemu:
    config:
      smp: 2
    type: jumpstarter_driver_qemu.driver.Qemu
  serial:
    ref: qemu.console
kind: ExporterConfig
metadata:
  name: pool-x7k2p
  namespace: lab
tls:
  ca: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCg==
token: tok-1
`, string(out))
	back, err := jsv1.ParseExporterConfig(out)
	require.NoError(t, err, "upstream's reader's checks pass")
	assert.True(t, back.ExitOnLeaseEnd)

	out, err = upstreamExporterConfig(vtSetWithDrivers(), true, "", "lab", "pool-x7k2p", "grpc.example:443", []byte("tok-1"))
	require.NoError(t, err)
	back, err = jsv1.ParseExporterConfig(out)
	require.NoError(t, err)
	assert.False(t, back.ExitOnLeaseEnd, "InPlaceReuse: the exporter stays for the next lease")
	assert.Equal(t, "", back.TLS.CA, "no CA bundle: empty, as upstream writes it (the system roots)")
	assert.Nil(t, back.Export)

	_, err = upstreamExporterConfig(vtSetWithDrivers(vtv1.DriverConfig{Name: "power", Type: "a"}, vtv1.DriverConfig{Name: "power", Type: "b"}),
		false, "", "lab", "x", "grpc.example:443", []byte("t"))
	require.Error(t, err)
	assert.Contains(t, err.Error(), `driver name "power" appears twice`)
}

func vtSetWithDrivers(drivers ...vtv1.DriverConfig) *vtv1.ExporterSet {
	set := vtSet("lab", "pool", "ours", 0)
	set.Spec.Template.Spec.Drivers = drivers
	return set
}
