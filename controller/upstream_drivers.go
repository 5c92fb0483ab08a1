package controller

import (
	"bytes"
	"encoding/json"
	"fmt"
	"sort"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/validation"

	vtv1 "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
)

// An upstream set's template drivers (spec.template.spec.drivers) mapped
// onto the VM pod. The node's exporter serves a fixed driver tree: power,
// console, flasher and one TCP driver per named container port, at the
// root. A driver entry this provisioner serves sizes the VM or adds a
// port; any other makes the set Degraded (ReasonUnsupportedDriver) with a
// message naming it: never dropped in silence.

// ReasonUnsupportedDriver is the Degraded reason of a set whose template
// asks for a driver this provisioner cannot serve.
const ReasonUnsupportedDriver = "UnsupportedDriver"

// Upstream driver types this provisioner serves.
const (
	DriverTypeQemu        = "jumpstarter_driver_qemu.driver.Qemu"
	DriverTypeQemuFlasher = "jumpstarter_driver_qemu.driver.QemuFlasher"
	DriverTypeQemuPower   = "jumpstarter_driver_power.driver.QemuPower"
	DriverTypeQemuSerial  = "jumpstarter_driver_serial.driver.QemuSerial"
	DriverTypePySerial    = "jumpstarter_driver_pyserial.driver.PySerial"
	DriverTypeTcpNetwork  = "jumpstarter_driver_network.driver.TcpNetwork"
)

// builtinDrivers are the node exporter's own drivers by type: the name
// each must have (the exporter serves them under that name only).
var builtinDrivers = map[string]string{
	DriverTypeQemuPower:   "power",
	DriverTypeQemuSerial:  "console",
	DriverTypePySerial:    "console",
	DriverTypeQemuFlasher: "flasher",
}

// qemuIgnoredKeys are Qemu driver settings of upstream's runtime sidecar
// that have no meaning on a virtual node (it picks the firmware by arch
// and runs QEMU itself).
var qemuIgnoredKeys = map[string]bool{"launcher_socket": true, "default_partitions": true}

// UpstreamDrivers is what a set's drivers ask of its VM pod.
type UpstreamDrivers struct {
	// CPU, Memory and Disk are the Qemu driver's smp, mem and disk_size
	// (nil when unset): the VM's size, over the resources.* parameters.
	CPU, Memory, Disk *resource.Quantity
	// Arch is the Qemu driver's arch ("" when unset).
	Arch string
	// Ports are the guest's TCP ports: the Qemu driver's hostfwd entries
	// (by name, the guest port) and the TcpNetwork drivers (by driver
	// name, config port), sorted by name.
	Ports []corev1.ContainerPort
}

// MapDrivers maps a set's template drivers. It is pure; an error's Reason
// and Message are the set's Degraded condition.
func MapDrivers(drivers []vtv1.DriverConfig) (UpstreamDrivers, *ClassError) {
	var out UpstreamDrivers
	bad := func(d vtv1.DriverConfig, format string, a ...any) *ClassError {
		what := d.Type
		if what == "" {
			what = "ref " + d.Ref
		}
		return &ClassError{ReasonUnsupportedDriver, fmt.Sprintf("driver %q (%s): ", d.Name, what) + fmt.Sprintf(format, a...)}
	}
	names := map[string]bool{}
	qemu := false
	for _, d := range drivers {
		if names[d.Name] {
			return out, bad(d, "a second driver of this name")
		}
		names[d.Name] = true
		if d.Ref != "" {
			return out, bad(d, "ref entries are not served: the node's exporter serves power, console, flasher and the guest's ports at the root")
		}
		cfg, err := driverConfig(d)
		if err != nil {
			return out, bad(d, "%v", err)
		}
		if want, ok := builtinDrivers[d.Type]; ok {
			if d.Name != want {
				return out, bad(d, "this provisioner's exporter serves it as driver %q: name it so", want)
			}
			if len(cfg) > 0 {
				return out, bad(d, "takes no config here (has %s)", keyList(cfg))
			}
			continue
		}
		switch d.Type {
		case DriverTypeQemu:
			if qemu {
				return out, bad(d, "a second Qemu driver: a pod is one VM")
			}
			qemu = true
			if err := out.qemu(cfg); err != nil {
				return out, bad(d, "%v", err)
			}
		case DriverTypeTcpNetwork:
			p, err := tcpPort(d.Name, cfg)
			if err != nil {
				return out, bad(d, "%v", err)
			}
			out.Ports = append(out.Ports, p)
		default:
			return out, bad(d, "not a driver this provisioner serves (%s, %s, %s, %s, %s, %s)", DriverTypeQemu, DriverTypeQemuPower,
				DriverTypeQemuSerial, DriverTypePySerial, DriverTypeQemuFlasher, DriverTypeTcpNetwork)
		}
	}
	sort.Slice(out.Ports, func(i, j int) bool { return out.Ports[i].Name < out.Ports[j].Name })
	for i := 1; i < len(out.Ports); i++ {
		if out.Ports[i].Name == out.Ports[i-1].Name {
			return out, &ClassError{ReasonUnsupportedDriver, fmt.Sprintf("port %q is named twice (a hostfwd entry and a TcpNetwork driver)", out.Ports[i].Name)}
		}
	}
	return out, nil
}

// driverConfig decodes a driver's config object (numbers kept exact).
func driverConfig(d vtv1.DriverConfig) (map[string]any, error) {
	if d.Config == nil || len(d.Config.Raw) == 0 {
		return nil, nil
	}
	dec := json.NewDecoder(bytes.NewReader(d.Config.Raw))
	dec.UseNumber()
	var m map[string]any
	if err := dec.Decode(&m); err != nil {
		return nil, fmt.Errorf("config is not a JSON object: %w", err)
	}
	return m, nil
}

// qemu reads the Qemu driver's config: arch, smp, mem, disk_size and
// hostfwd.
func (out *UpstreamDrivers) qemu(cfg map[string]any) error {
	for _, k := range sortedKeys(cfg) {
		v := cfg[k]
		var err error
		switch k {
		case "arch":
			s, ok := v.(string)
			if !ok || kubeArch[s] == "" {
				return fmt.Errorf("arch %v: not an architecture of this provisioner (x86_64, amd64, aarch64, arm64)", v)
			}
			out.Arch = s
		case "smp":
			out.CPU, err = qemuQuantity(k, v, false)
		case "mem":
			out.Memory, err = qemuQuantity(k, v, true)
		case "disk_size":
			out.Disk, err = qemuQuantity(k, v, true)
		case "hostfwd":
			err = out.hostfwd(v)
		default:
			if !qemuIgnoredKeys[k] {
				return fmt.Errorf("config key %q is not served (arch, smp, mem, disk_size, hostfwd)", k)
			}
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// hostfwd reads {name: {guestport: N, ...}}: each entry a guest port the
// exporter serves under name (a virtual node needs no host port).
func (out *UpstreamDrivers) hostfwd(v any) error {
	m, ok := v.(map[string]any)
	if !ok {
		return fmt.Errorf("hostfwd must be an object of {name: {guestport: N}}, not %s", jsonKind(v))
	}
	for _, name := range sortedKeys(m) {
		e, ok := m[name].(map[string]any)
		if !ok {
			return fmt.Errorf("hostfwd %q must be an object with guestport, not %s", name, jsonKind(m[name]))
		}
		p, err := portOf(e["guestport"])
		if err != nil {
			return fmt.Errorf("hostfwd %q: guestport: %v", name, err)
		}
		cp, err := namedPort(name, p)
		if err != nil {
			return fmt.Errorf("hostfwd %q: %v", name, err)
		}
		out.Ports = append(out.Ports, cp)
	}
	return nil
}

// tcpPort reads a TcpNetwork driver: the guest port it reaches.
func tcpPort(name string, cfg map[string]any) (corev1.ContainerPort, error) {
	for k, v := range cfg {
		switch k {
		case "port":
		case "host":
			if h, _ := v.(string); h != "" && h != "127.0.0.1" && h != "localhost" {
				return corev1.ContainerPort{}, fmt.Errorf("host %v: only the guest is reachable (leave host unset)", v)
			}
		default:
			return corev1.ContainerPort{}, fmt.Errorf("config key %q is not served (port, host)", k)
		}
	}
	p, err := portOf(cfg["port"])
	if err != nil {
		return corev1.ContainerPort{}, fmt.Errorf("port: %v", err)
	}
	return namedPort(name, p)
}

func namedPort(name string, port int32) (corev1.ContainerPort, error) {
	if errs := validation.IsValidPortName(name); len(errs) > 0 {
		return corev1.ContainerPort{}, fmt.Errorf("the name is the guest port's name, which must be a port name: %s", strings.Join(errs, "; "))
	}
	if _, builtin := exporterOwnNames[name]; builtin {
		return corev1.ContainerPort{}, fmt.Errorf("%q is the name of one of the exporter's own drivers", name)
	}
	return corev1.ContainerPort{Name: name, ContainerPort: port, Protocol: corev1.ProtocolTCP}, nil
}

// exporterOwnNames are the node exporter's own driver names: no guest port
// may take them.
var exporterOwnNames = map[string]struct{}{"power": {}, "console": {}, "flasher": {}, "vnc": {}}

func portOf(v any) (int32, error) {
	n, ok := v.(json.Number)
	if !ok {
		return 0, fmt.Errorf("must be a number, not %s", jsonKind(v))
	}
	i, err := n.Int64()
	if err != nil || i < 1 || i > 65535 {
		return 0, fmt.Errorf("%s is not a port (1-65535)", n)
	}
	return int32(i), nil
}

// qemuQuantity reads smp (a count) or mem/disk_size (QEMU's sizes: "1G"
// is 1 GiB; Kubernetes quantities such as "1Gi" too).
func qemuQuantity(key string, v any, size bool) (*resource.Quantity, error) {
	s, ok := scalarText(v)
	if !ok {
		return nil, fmt.Errorf("%s must be a number or string, not %s", key, jsonKind(v))
	}
	if size && len(s) > 1 && strings.ContainsRune("KMGT", rune(s[len(s)-1])) {
		s += "i" // QEMU's suffixes are binary
	}
	q, err := resource.ParseQuantity(s)
	if err != nil {
		return nil, fmt.Errorf("%s %q: %w", key, v, err)
	}
	if q.Sign() <= 0 {
		return nil, fmt.Errorf("%s %q must be positive", key, v)
	}
	return &q, nil
}

func sortedKeys(m map[string]any) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

func keyList(m map[string]any) string { return strings.Join(sortedKeys(m), ", ") }
