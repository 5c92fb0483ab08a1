package podspec

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"unicode"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// The guest login of a Jumpstarter exporter pod: the keys username and
// password of the pod's exporter Secret (api/v1alpha1
// JumpstarterSecretUsername, JumpstarterSecretPassword; in Jumpstarter
// mode the ExporterSet controller copies them from the Secret its
// spec.jumpstarter.guestLoginSecretName names, or writes the login it
// generated for the pod: spec.jumpstarter.defaultGuestLogin). The exporter
// answers them to get_username and get_password, and the guest gets them
// through the NoCloud seed as vendor-data (a #cloud-config creating the
// user with that password, password login over ssh allowed):
// QemuClient.shell() then logs in through the ssh driver, as with
// upstream's QEMU driver. The pod's own user-data is left alone
// (cloud-init merges user-data over vendor-data, so a user-data that sets
// users, chpasswd or ssh_pwauth itself wins). The password is written to
// the seed disk only: never to logs, events, conditions or other files
// (CreateConfigDisk feeds mcopy on stdin).

// GuestLogin is the guest's login user and password.
type GuestLogin struct {
	Username string
	Password string
}

// String hides the password.
func (l GuestLogin) String() string { return "{Username:" + l.Username + " Password:<redacted>}" }

// GoString hides the password from %#v.
func (l GuestLogin) GoString() string { return l.String() }

var guestUserRE = regexp.MustCompile(`^[a-z_][a-z0-9_-]{0,31}$`)

// MaxGuestPasswordBytes bounds the guest password.
const MaxGuestPasswordBytes = 256

// GuestLoginFromSecret reads the login from the exporter Secret: nil when
// it has neither key; an error naming the key (never the password) when
// only one is set or a value is unusable. where names the Secret. Pure.
func GuestLoginFromSecret(secret *corev1.Secret, where string) (*GuestLogin, error) {
	val := func(k string) string {
		if b, ok := secret.Data[k]; ok {
			return string(b)
		}
		return secret.StringData[k]
	}
	user := strings.TrimSpace(val(v1alpha1.JumpstarterSecretUsername))
	pass := strings.TrimRight(val(v1alpha1.JumpstarterSecretPassword), "\r\n")
	switch {
	case user == "" && pass == "":
		return nil, nil
	case user == "":
		return nil, &ConfigError{Msg: fmt.Sprintf("%s: key %q is set but %q is missing or empty (the guest login needs both)", where, v1alpha1.JumpstarterSecretPassword, v1alpha1.JumpstarterSecretUsername)}
	case pass == "":
		return nil, &ConfigError{Msg: fmt.Sprintf("%s: key %q is set but %q is missing or empty (the guest login needs both)", where, v1alpha1.JumpstarterSecretUsername, v1alpha1.JumpstarterSecretPassword)}
	case !guestUserRE.MatchString(user):
		return nil, &ConfigError{Msg: fmt.Sprintf("%s: key %q: %q is not a Linux user name (lower-case letters, digits, '_' or '-', at most 32, not starting with a digit or '-')", where, v1alpha1.JumpstarterSecretUsername, user)}
	case user == "root":
		return nil, &ConfigError{Msg: fmt.Sprintf("%s: key %q: root cannot be the guest login (ssh refuses root passwords by default); name a user, it gets sudo", where, v1alpha1.JumpstarterSecretUsername)}
	case len(pass) > MaxGuestPasswordBytes:
		return nil, &ConfigError{Msg: fmt.Sprintf("%s: key %q: the password is longer than %d bytes", where, v1alpha1.JumpstarterSecretPassword, MaxGuestPasswordBytes)}
	case strings.IndexFunc(pass, unicode.IsControl) >= 0:
		return nil, &ConfigError{Msg: fmt.Sprintf("%s: key %q: the password holds a control character (new line, tab...): chpasswd cannot set it", where, v1alpha1.JumpstarterSecretPassword)}
	}
	return &GuestLogin{Username: user, Password: pass}, nil
}

// cloudUser is one entry of cloud-config's users.
type cloudUser struct {
	Name            string `json:"name"`
	LockPasswd      bool   `json:"lock_passwd"`
	PlainTextPasswd string `json:"plain_text_passwd"`
	Shell           string `json:"shell"`
	Sudo            string `json:"sudo"`
}

// VendorData is the #cloud-config that creates the login in the guest:
// the distribution's default user kept, the login user with the password
// (plain_text_passwd, which every cloud-init version reads, and chpasswd's
// users list, not expiring), sudo without a password as upstream's driver
// gives it, and password login over ssh (ssh_pwauth). Pure.
func (l GuestLogin) VendorData() []byte {
	doc := map[string]any{
		"users": []any{"default", cloudUser{Name: l.Username, LockPasswd: false, PlainTextPasswd: l.Password, Shell: "/bin/bash", Sudo: "ALL=(ALL) NOPASSWD:ALL"}},
		"chpasswd": map[string]any{
			"expire": false,
			"users":  []any{map[string]any{"name": l.Username, "password": l.Password, "type": "text"}},
		},
		"ssh_pwauth": true,
	}
	b, err := yaml.Marshal(doc)
	if err != nil { // plain strings and bools always marshal
		panic(fmt.Sprintf("guest login vendor-data: %v", err))
	}
	return append([]byte("#cloud-config\n# qemu-kubelet: the Jumpstarter exporter's guest login (get_username, get_password)\n"), b...)
}

// Files of a NoCloud seed.
const (
	seedMetaData   = "meta-data"
	seedUserData   = "user-data"
	seedVendorData = "vendor-data"
)

// exporterGuestLogin is the guest login of pod's exporter Secret (nil:
// the pod is no exporter, or its Secret names no login).
func exporterGuestLogin(ctx context.Context, pod *corev1.Pod, src ConfigSources) (*GuestLogin, error) {
	name := ExporterSecretName(pod)
	if name == "" {
		return nil, nil
	}
	s, err := GetSecret(ctx, src, pod.Namespace, name)
	if err != nil {
		return nil, err
	}
	if s == nil {
		return nil, ExporterSecretNotFound(pod)
	}
	return GuestLoginFromSecret(s, ExporterSecretWhere(pod))
}

// withGuestLogin adds the login's vendor-data to the pod's NoCloud seed,
// making a seed when the pod has none (meta-data as for a cloud-init
// volume, an empty user-data: NoCloud needs both files). A pod whose
// cloud-init volume holds its own vendor-data cannot get the login: a
// ConfigError says so. Pure.
func withGuestLogin(disks []guestDisk, pod *corev1.Pod, login *GuestLogin) ([]guestDisk, error) {
	if login == nil {
		return disks, nil
	}
	for i, d := range disks {
		if d.Name != CloudInitVolumeName {
			continue
		}
		if _, ok := d.Files[seedVendorData]; ok {
			return nil, &ConfigError{Msg: fmt.Sprintf("volume %q holds vendor-data, and %s names a guest login (keys %q, %q): the node seeds that login as vendor-data; move your cloud-config to user-data, or remove the login from the Secret (an ExporterSet's pod: no spec.jumpstarter.guestLoginSecretName and spec.jumpstarter.defaultGuestLogin None)",
				CloudInitVolumeName, ExporterSecretWhere(pod), v1alpha1.JumpstarterSecretUsername, v1alpha1.JumpstarterSecretPassword)}
		}
		files := make(map[string][]byte, len(d.Files)+2)
		for k, v := range d.Files {
			files[k] = v
		}
		if _, ok := files[seedUserData]; !ok {
			files[seedUserData] = []byte{}
		}
		files[seedVendorData] = login.VendorData()
		out := append([]guestDisk(nil), disks...)
		out[i].Files = files
		return out, nil
	}
	seed := guestDisk{Name: CloudInitVolumeName, Label: CloudInitLabel, Files: map[string][]byte{
		seedMetaData:   []byte(fmt.Sprintf("instance-id: %s\nlocal-hostname: %s\n", pod.UID, pod.Name)),
		seedUserData:   {},
		seedVendorData: login.VendorData(),
	}}
	return append(append([]guestDisk(nil), disks...), seed), nil
}
