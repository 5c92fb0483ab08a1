package jumpstarter

import (
	"crypto/sha1"
	"errors"
	"fmt"
	"maps"
	"regexp"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// Client classes the report names (the jumpstarter.dev/client label): the
// Python clients Jumpstarter users load for upstream's QEMU driver
// (python/packages/jumpstarter-driver-{qemu,power,pyserial,network} at
// b1f2bb41), so their scripts run unchanged on our VMs. The console is
// PySerialClient, as upstream's standalone QEMU driver reports it: its
// pexpect(), open(), start-console and pipe all stream `connect`, which a
// NetworkClient script uses too.
const (
	ClassQemu    = "jumpstarter_driver_qemu.client.QemuClient"
	ClassPower   = "jumpstarter_driver_power.client.PowerClient"
	ClassFlasher = "jumpstarter_driver_qemu.client.QemuFlasherClient"
	ClassSerial  = "jumpstarter_driver_pyserial.client.PySerialClient"
	ClassNetwork = "jumpstarter_driver_network.client.NetworkClient"

	// LabelClient and LabelName are the report labels the Python client
	// builds its driver tree from.
	LabelClient = "jumpstarter.dev/client"
	LabelName   = "jumpstarter.dev/name"
)

// Child driver names every target has (Config.Ports add one each).
const (
	DriverPower   = "power"
	DriverFlasher = "flasher"
	DriverConsole = "console"
)

// DriverSSH and DefaultSSHPort are the ssh child upstream's QEMU driver
// always reports (a NetworkClient; QemuClient.shell() logs in over it):
// the node's exporters report it as a Config.Ports entry, a guest TCP
// port, by default.
const (
	DriverSSH      = "ssh"
	DefaultSSHPort = 22
)

// Errors a Target may wrap so that a call fails with the matching gRPC code
// (InvalidArgument, Unimplemented); other errors fail with Unknown, as
// upstream's drivers do for an unexpected exception.
var (
	ErrInvalidArgument = errors.New("invalid argument")
	ErrUnsupported     = errors.New("not supported")
)

type driverKind int

const (
	kindRoot driverKind = iota
	kindPower
	kindFlasher
	kindConsole
	kindPort
	kindDisplay
)

// driver is one entry of the report; the tree is fixed at New.
type driver struct {
	uuid, parent string // lowercase canonical UUIDs; parent "" for the root
	name         string // jumpstarter.dev/name ("" for the root)
	class        string
	kind         driverKind
	port         int  // kindPort
	help         help // description, methods_description (help.go)
}

var portNameRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?$`)

// buildTree returns the drivers, parents before children, exactly one root.
// UUIDs are derived from the exporter's namespace/name so they stay the
// same across reconnects and agent restarts.
func buildTree(ns, name string, ports []Port, display bool) ([]*driver, error) {
	id := func(child string) string { return nameUUID(ns + "/" + name + "/" + child) }
	root := &driver{uuid: id(""), class: ClassQemu, kind: kindRoot}
	ds := []*driver{root,
		{uuid: id(DriverPower), parent: root.uuid, name: DriverPower, class: ClassPower, kind: kindPower},
		{uuid: id(DriverFlasher), parent: root.uuid, name: DriverFlasher, class: ClassFlasher, kind: kindFlasher},
		{uuid: id(DriverConsole), parent: root.uuid, name: DriverConsole, class: ClassSerial, kind: kindConsole},
	}
	seen := map[string]bool{DriverPower: true, DriverFlasher: true, DriverConsole: true}
	if display {
		ds = append(ds, &driver{uuid: id(DriverVNC), parent: root.uuid, name: DriverVNC, class: ClassNetwork, kind: kindDisplay})
		seen[DriverVNC] = true
	}
	for _, p := range ports {
		if !portNameRE.MatchString(p.Name) {
			return nil, fmt.Errorf("port %q: a driver name must be lowercase letters, digits, '-' or '_' (at most 63)", p.Name)
		}
		if seen[p.Name] {
			return nil, fmt.Errorf("port %q: the name is taken (power, flasher, console and vnc are built in, port names must be unique)", p.Name)
		}
		if p.Port < 1 || p.Port > 65535 {
			return nil, fmt.Errorf("port %q: port %d is not in 1..65535", p.Name, p.Port)
		}
		seen[p.Name] = true
		ds = append(ds, &driver{uuid: id("port/" + p.Name), parent: root.uuid, name: p.Name, class: ClassNetwork, kind: kindPort, port: p.Port})
	}
	for _, d := range ds {
		d.help = helpOf(d.kind, d.port)
	}
	return ds, nil
}

// report is the DriverInstanceReport of d.
func (d *driver) report() *pb.DriverInstanceReport {
	r := &pb.DriverInstanceReport{Uuid: d.uuid, Labels: map[string]string{LabelClient: d.class}}
	if d.parent != "" {
		p := d.parent
		r.ParentUuid = &p
		r.Labels[LabelName] = d.name
	}
	if d.help.description != "" {
		desc := d.help.description
		r.Description = &desc
	}
	if len(d.help.methods) > 0 {
		r.MethodsDescription = maps.Clone(d.help.methods)
	}
	return r
}

// nameUUID is a name-based (version 5 style, SHA-1) UUID in canonical
// lowercase form.
func nameUUID(s string) string {
	h := sha1.Sum([]byte("qemu-kubelet.io/jumpstarter/" + s))
	b := h[:16]
	b[6] = (b[6] & 0x0f) | 0x50
	b[8] = (b[8] & 0x3f) | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// canonicalUUID parses s (any case, with dashes) into the lowercase
// canonical form, or fails.
var uuidRE = regexp.MustCompile(`^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$`)

func canonicalUUID(s string) (string, bool) {
	if !uuidRE.MatchString(s) {
		return "", false
	}
	b := []byte(s)
	for i, c := range b {
		if c >= 'A' && c <= 'F' {
			b[i] = c + 'a' - 'A'
		}
	}
	return string(b), true
}
