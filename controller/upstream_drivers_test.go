package controller

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	vtv1 "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
)

func drv(name, typ, config string) vtv1.DriverConfig {
	d := vtv1.DriverConfig{Name: name, Type: typ}
	if config != "" {
		d.Config = &apiextv1.JSON{Raw: []byte(config)}
	}
	return d
}

// TestMapDrivers: the drivers a set's template names, as upstream writes
// them, map onto the VM's size, arch and guest ports; each one this
// provisioner cannot serve makes a Degraded message naming it.
func TestMapDrivers(t *testing.T) {
	q := resource.MustParse
	tcp := func(name string, port int32) corev1.ContainerPort {
		return corev1.ContainerPort{Name: name, ContainerPort: port, Protocol: corev1.ProtocolTCP}
	}
	for _, tc := range []struct {
		name    string
		drivers []vtv1.DriverConfig
		want    UpstreamDrivers
		bad     string // a substring of the Degraded message; "" = served
	}{
		{name: "none"},
		{name: "upstream's e2e Qemu driver", drivers: []vtv1.DriverConfig{
			drv("qemu", DriverTypeQemu, `{"arch":"x86_64","smp":1,"mem":"1G","disk_size":"10G"}`)},
			want: UpstreamDrivers{CPU: new(q("1")), Memory: new(q("1Gi")), Disk: new(q("10Gi")), Arch: "x86_64"}},
		{name: "kubernetes quantities and hostfwd", drivers: []vtv1.DriverConfig{
			drv("qemu", DriverTypeQemu, `{"smp":"2","mem":"512Mi","hostfwd":{"ssh":{"hostaddr":"127.0.0.1","hostport":2222,"guestport":22},"http":{"guestport":8080}},"launcher_socket":"/x"}`),
			drv("power", DriverTypeQemuPower, ""), drv("console", DriverTypeQemuSerial, ""), drv("flasher", DriverTypeQemuFlasher, ""),
			drv("db", DriverTypeTcpNetwork, `{"port":5432,"host":"127.0.0.1"}`)},
			want: UpstreamDrivers{CPU: new(q("2")), Memory: new(q("512Mi")), Ports: []corev1.ContainerPort{tcp("db", 5432), tcp("http", 8080), tcp("ssh", 22)}}},
		{name: "upstream's sample tcp driver", drivers: []vtv1.DriverConfig{drv("tcp", DriverTypeTcpNetwork, `{"port":22}`)},
			want: UpstreamDrivers{Ports: []corev1.ContainerPort{tcp("tcp", 22)}}},

		{name: "serial under another name", drivers: []vtv1.DriverConfig{drv("serial", DriverTypeQemuSerial, "")},
			bad: `driver "serial" (jumpstarter_driver_serial.driver.QemuSerial): this provisioner's exporter serves it as driver "console"`},
		{name: "unknown type", drivers: []vtv1.DriverConfig{drv("can", "jumpstarter_driver_can.driver.Can", "")},
			bad: `driver "can" (jumpstarter_driver_can.driver.Can): not a driver this provisioner serves`},
		{name: "ref", drivers: []vtv1.DriverConfig{{Name: "pw", Ref: "qemu.power"}}, bad: `driver "pw" (ref qemu.power): ref entries are not served`},
		{name: "duplicate name", drivers: []vtv1.DriverConfig{drv("power", DriverTypeQemuPower, ""), drv("power", DriverTypeQemuPower, "")},
			bad: `driver "power" (jumpstarter_driver_power.driver.QemuPower): a second driver of this name`},
		{name: "two VMs", drivers: []vtv1.DriverConfig{drv("a", DriverTypeQemu, ""), drv("b", DriverTypeQemu, "")}, bad: `driver "b"`},
		{name: "unknown qemu key", drivers: []vtv1.DriverConfig{drv("qemu", DriverTypeQemu, `{"machine":"virt"}`)},
			bad: `driver "qemu" (jumpstarter_driver_qemu.driver.Qemu): config key "machine" is not served`},
		{name: "bad arch", drivers: []vtv1.DriverConfig{drv("qemu", DriverTypeQemu, `{"arch":"riscv64"}`)}, bad: "arch riscv64"},
		{name: "bad mem", drivers: []vtv1.DriverConfig{drv("qemu", DriverTypeQemu, `{"mem":"lots"}`)}, bad: `mem "lots"`},
		{name: "zero smp", drivers: []vtv1.DriverConfig{drv("qemu", DriverTypeQemu, `{"smp":0}`)}, bad: "must be positive"},
		{name: "hostfwd port", drivers: []vtv1.DriverConfig{drv("qemu", DriverTypeQemu, `{"hostfwd":{"ssh":{"guestport":70000}}}`)},
			bad: `hostfwd "ssh": guestport: 70000 is not a port`},
		{name: "hostfwd name", drivers: []vtv1.DriverConfig{drv("qemu", DriverTypeQemu, `{"hostfwd":{"Web_UI":{"guestport":80}}}`)},
			bad: `hostfwd "Web_UI": the name is the guest port's name`},
		{name: "port named after a built-in", drivers: []vtv1.DriverConfig{drv("console", DriverTypeTcpNetwork, `{"port":23}`)},
			bad: `"console" is the name of one of the exporter's own drivers`},
		{name: "tcp to another host", drivers: []vtv1.DriverConfig{drv("tcp", DriverTypeTcpNetwork, `{"port":22,"host":"10.0.0.1"}`)},
			bad: "only the guest is reachable"},
		{name: "same port name twice", drivers: []vtv1.DriverConfig{drv("qemu", DriverTypeQemu, `{"hostfwd":{"ssh":{"guestport":22}}}`),
			drv("ssh", DriverTypeTcpNetwork, `{"port":2022}`)}, bad: `port "ssh" is named twice`},
		{name: "power with config", drivers: []vtv1.DriverConfig{drv("power", DriverTypeQemuPower, `{"x":1}`)}, bad: "takes no config here (has x)"},
		{name: "config not an object", drivers: []vtv1.DriverConfig{drv("qemu", DriverTypeQemu, `[1]`)}, bad: "config is not a JSON object"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := MapDrivers(tc.drivers)
			if tc.bad != "" {
				require.NotNil(t, err, "want Degraded: %s", tc.bad)
				assert.Equal(t, ReasonUnsupportedDriver, err.Reason)
				assert.Contains(t, err.Message, tc.bad)
				return
			}
			require.Nil(t, err)
			assert.Equal(t, tc.want, got)
		})
	}
}

// TestMapUpstreamDrivers: the Qemu driver's smp, mem and disk_size size the
// VM over the resources parameters, its arch selects the node, its
// hostfwd entries are the container's ports; a driver that cannot be
// served is the set's Degraded condition.
func TestMapUpstreamDrivers(t *testing.T) {
	class := &vtv1.VirtualTargetClass{Spec: vtv1.VirtualTargetClassSpec{Provisioner: vtv1.DefaultProvisioner,
		Parameters: &apiextv1.JSON{Raw: []byte(`{"qemuKubelet":{"image":"reg.invalid/os:1"},"resources":{"cpu":"4","memory":"4Gi"}}`)}}}
	set := &vtv1.ExporterSet{Spec: vtv1.ExporterSetSpec{VirtualTargetClassName: "c"}}
	set.Name = "s"
	set.Spec.Template.Spec.Drivers = []vtv1.DriverConfig{drv("qemu", DriverTypeQemu, `{"arch":"aarch64","mem":"1G","hostfwd":{"ssh":{"guestport":22}}}`)}
	spec, err := MapUpstream(set, class, 0)
	require.Nil(t, err)
	c := spec.Template.Spec.Containers[0]
	assert.Equal(t, "1Gi", new(c.Resources.Limits[corev1.ResourceMemory]).String(), "the driver's mem over resources.memory")
	assert.Equal(t, "4", new(c.Resources.Limits[corev1.ResourceCPU]).String(), "resources.cpu where the driver says nothing")
	assert.Equal(t, "arm64", spec.Template.Spec.NodeSelector[corev1.LabelArchStable])
	assert.Equal(t, []corev1.ContainerPort{{Name: "ssh", ContainerPort: 22, Protocol: corev1.ProtocolTCP}}, c.Ports)

	set.Spec.Parameters = &apiextv1.JSON{Raw: []byte(`{"arch":"x86_64"}`)}
	_, err = MapUpstream(set, class, 0)
	require.NotNil(t, err)
	assert.Equal(t, ReasonUnsupportedDriver, err.Reason)
	assert.Contains(t, err.Message, "arch aarch64 differs from parameter arch x86_64")

	set.Spec.Parameters = nil
	set.Spec.Template.Spec.Drivers = append(set.Spec.Template.Spec.Drivers, drv("serial", DriverTypeQemuSerial, ""))
	_, err = MapUpstream(set, class, 0)
	require.NotNil(t, err)
	assert.Contains(t, err.Message, `driver "serial"`)
}
